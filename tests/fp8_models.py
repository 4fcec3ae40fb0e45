"""FP8 model folders for the tests, written as llm-compressor (compressed-tensors) writes them,
and the float32 transformers reference of an FP8 model.

* :func:`write_fp8_checkpoint` turns a tiny model folder into an FP8 checkpoint: every Linear of
  the decoder layers as float8_e4m3fn with a float32 ``weight_scale`` (per output channel,
  ``[N, 1]``, or per tensor, ``[1]``), optionally a static ``input_scale`` per Linear (calibrated
  as llm-compressor does: the largest input magnitude over sample prompts / 448) and K/V cache
  scales, and ``config.json`` with the ``quantization_config`` that names the scheme. Beside it
  goes the *dequantized twin*: the same numbers (float8 x scale) as an ordinary folder.
* :func:`write_fused_twin` writes the dequantized twin of a per-tensor checkpoint as a server
  that fuses q/k/v and gate/up into one matmul holds it (SGLang and vLLM do, for per-tensor
  scales): each fused group's float8 weights requantized to the group's largest weight_scale.
* :func:`fp8_reference_logprobs` runs transformers in float32 on a twin with every Linear's
  input rounded through float8 as the scheme says (per token, or with the static scale): the
  FP8 model's function, computed independently of the engine.

Written from the compressed-tensors format description, with torch's own float8 cast (round to
nearest even); nothing here imports the engine.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_FUSED = {
    "q_proj": "qkv",
    "k_proj": "qkv",
    "v_proj": "qkv",
    "gate_proj": "gate_up",
    "up_proj": "gate_up",
}


def _to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def _is_linear(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in _LINEARS


@torch.no_grad()
def _calibrate(model_dir: Path, prompts: list[list[int]]) -> dict[str, float]:
    """The largest |input| of every decoder Linear over `prompts` (transformers, float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    amax: dict[str, float] = {}
    hooks = []
    for name, module in model.named_modules():
        if name.split(".")[-1] in _LINEARS:

            def hook(mod, args, name=name):
                amax[name] = max(amax.get(name, 0.0), args[0].abs().max().item())

            hooks.append(module.register_forward_pre_hook(hook))
    for ids in prompts:
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return amax


def write_fp8_checkpoint(
    src: Path,
    out: Path,
    *,
    strategy: str = "channel",
    static_prompts: list[list[int]] | None = None,
    kv_scales: dict[int, tuple[float, float]] | None = None,
) -> tuple[Path, Path]:
    """(fp8 folder, dequantized twin folder) of the model in `src`. `strategy`: the weight
    scales, "channel" or "tensor"; `static_prompts`: calibrate static input scales on them
    (else activations are dynamic per token); `kv_scales`: {layer: (k_scale, v_scale)}."""
    src, out = Path(src), Path(out)
    fp8_dir, twin_dir = out / "fp8", out / "twin"
    for folder in (fp8_dir, twin_dir):
        shutil.copytree(src, folder, dirs_exist_ok=True)
        for old in folder.glob("*.safetensors*"):
            old.unlink()
        for old in folder.glob("*.index.json"):
            old.unlink()
    state: dict[str, torch.Tensor] = {}
    for file in sorted(src.glob("*.safetensors")):
        state.update(load_file(file))
    amax = _calibrate(src, static_prompts) if static_prompts else {}
    quantized: dict[str, torch.Tensor] = {}
    twin: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        if not _is_linear(name):
            quantized[name] = twin[name] = w
            continue
        wf = w.float()
        if strategy == "channel":
            scale = (wf.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)  # [N, 1]
        elif strategy == "tensor":
            scale = (wf.abs().amax() / FP8_MAX).clamp(min=1e-12).reshape(1)
        else:
            raise ValueError(f"strategy must be 'channel' or 'tensor', got {strategy!r}")
        w8 = _to_fp8(wf, scale)
        prefix = name.removesuffix(".weight")
        quantized[name] = w8
        quantized[f"{prefix}.weight_scale"] = scale.float()
        if static_prompts:
            module = prefix.removeprefix("model.") if prefix not in amax else prefix
            key = next(k for k in amax if k.endswith(module.removeprefix("model.")))
            quantized[f"{prefix}.input_scale"] = torch.tensor([amax[key] / FP8_MAX])
        twin[name] = w8.float() * scale  # (float32: exact up to float32 rounding)
    for layer, (k, v) in (kv_scales or {}).items():
        quantized[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(k)
        quantized[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(v)
    save_file(quantized, fp8_dir / "model.safetensors")
    save_file(twin, twin_dir / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    inputs = (
        {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
        if static_prompts
        else {
            "num_bits": 8,
            "type": "float",
            "strategy": "token",
            "dynamic": True,
            "symmetric": True,
        }
    )
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": strategy,
                    "dynamic": False,
                    "symmetric": True,
                },  # fmt: skip
                "input_activations": inputs,
            }
        },
        "ignore": ["lm_head"],
    }
    (fp8_dir / "config.json").write_text(json.dumps(config, indent=2))
    return fp8_dir, twin_dir


def write_fused_twin(fp8_dir: Path, twin_dir: Path, out: Path) -> Path:
    """`twin_dir` with each fused group (q/k/v, gate/up) of the per-tensor FP8 folder `fp8_dir`
    requantized to the group's largest weight_scale s: a shard of scale t becomes float8(w8 x
    (t / s)) x s, its values shrunk by t / s (at most 1) and rounded to float8 once more."""
    state = load_file(Path(fp8_dir) / "model.safetensors")
    groups: dict[str, list[str]] = {}
    for name in state:
        if _is_linear(name) and name.split(".")[-2] in _FUSED:
            module, projection = name.removesuffix(".weight").rsplit(".", 1)
            groups.setdefault(f"{module}.{_FUSED[projection]}", []).append(name)
    twin = load_file(Path(twin_dir) / "model.safetensors")
    for names in groups.values():
        scales = [state[n.replace(".weight", ".weight_scale")].float() for n in names]
        if any(s.numel() != 1 for s in scales):
            raise ValueError("write_fused_twin is for per-tensor weight scales")
        top = torch.stack([s.reshape(()) for s in scales]).max()
        for name, scale in zip(names, scales):
            ratio = scale.reshape(()) / top
            twin[name] = (state[name].float() * ratio).to(FP8).float() * top
    shutil.copytree(twin_dir, out, dirs_exist_ok=True)
    save_file(twin, Path(out) / "model.safetensors")
    return Path(out)


def input_scales(fp8_dir: Path) -> dict[str, float]:
    """The static input scales of an FP8 folder, by module name (without "model.")."""
    state = load_file(Path(fp8_dir) / "model.safetensors")
    return {
        k.removesuffix(".input_scale"): v.item()
        for k, v in state.items()
        if k.endswith(".input_scale")
    }


@torch.no_grad()
def fp8_reference_logprobs(
    twin_dir: Path, ids: list[int], static: dict[str, float] | None = None
) -> torch.Tensor:
    """Teacher-forced log-softmax [len(ids), vocab] of the FP8 model: transformers in float32
    on its dequantized twin, each decoder Linear's input rounded through float8 (per token, or
    with the static scale of `static`, by module name)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        twin_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    hooks = []
    for name, module in model.named_modules():
        if name.split(".")[-1] not in _LINEARS:
            continue

        def round_input(mod, args, name=name):
            x = args[0].float()
            if static is not None:
                scale = torch.tensor(static[name])
            else:
                scale = (x.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
            return (_to_fp8(x, scale).float() * scale,)

        hooks.append(module.register_forward_pre_hook(round_input))
    logits = model(torch.tensor([ids])).logits[0]
    for h in hooks:
        h.remove()
    return torch.log_softmax(logits.float(), dim=-1)
