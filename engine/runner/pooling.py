"""How hidden states become one embedding per input: pooling, normalization, dimensions.

The model folder says how, in sentence-transformers' layout: `modules.json` lists the modules
(a `Pooling` module whose folder has `config.json` with `pooling_mode_cls_token`,
`pooling_mode_mean_tokens` or `pooling_mode_lasttoken`; a `Normalize` module). A folder without
it gets SGLang's defaults: CLS pooling for encoders, last-token pooling for decoders, both
normalized.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

POOLING_METHODS = ("cls", "mean", "last")


@dataclass(frozen=True)
class PoolingConfig:
    method: str  # one of POOLING_METHODS
    normalize: bool

    @classmethod
    def from_folder(cls, folder: Path, is_encoder: bool) -> PoolingConfig:
        default = cls("cls" if is_encoder else "last", normalize=True)
        modules_file = folder / "modules.json"
        if not modules_file.is_file():
            return default
        try:
            modules = json.loads(modules_file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{modules_file} is not valid JSON: {e}") from None
        types = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules}
        normalize = "Normalize" in types
        pooling = types.get("Pooling")
        if pooling is None:
            return cls(default.method, normalize)
        pooling_file = folder / pooling.get("path", "") / "config.json"
        if not pooling_file.is_file():
            raise ValueError(
                f"{modules_file} names a Pooling module but {pooling_file} is missing."
            )
        return cls(_method(json.loads(pooling_file.read_text()), pooling_file), normalize)


def _method(cfg: dict, where: Path) -> str:
    modes = {
        "cls": cfg.get("pooling_mode_cls_token", False),
        "mean": cfg.get("pooling_mode_mean_tokens", False),
        "last": cfg.get("pooling_mode_lasttoken", False),
    }
    if mode := cfg.get("pooling_mode"):  # newer sentence-transformers write one string
        modes = {"cls": mode == "cls", "mean": mode == "mean", "last": mode == "lasttoken"}
    chosen = [m for m, on in modes.items() if on]
    unsupported = [
        k
        for k in (
            "pooling_mode_max_tokens",
            "pooling_mode_mean_sqrt_len_tokens",
            "pooling_mode_weightedmean_tokens",
        )
        if cfg.get(k)
    ]
    if len(chosen) != 1 or unsupported:
        raise ValueError(
            f"{where}: exactly one of CLS, mean or last-token pooling must be on; "
            f"got {chosen + unsupported or 'none'}."
        )
    return chosen[0]


def pool(
    hidden: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, method: str
) -> torch.Tensor:
    """hidden [T, H] with the sequences packed one after another (sequence i at rows
    starts[i] .. starts[i] + lengths[i]) -> [B, H] in float32."""
    if method == "cls":
        return hidden[starts].float()
    if method == "last":
        return hidden[starts + lengths - 1].float()
    # mean: a segment sum via index_add over each row's sequence index
    # NOTE: output_size given, so the device need not tell the host the total (no sync)
    seq = torch.repeat_interleave(
        torch.arange(len(lengths), device=hidden.device), lengths, output_size=hidden.shape[0]
    )
    sums = torch.zeros(len(lengths), hidden.shape[1], dtype=torch.float32, device=hidden.device)
    sums.index_add_(0, seq, hidden.float())
    return sums / lengths[:, None].float()


def finish_embeddings(
    pooled: torch.Tensor, dimensions: torch.Tensor, normalize: bool
) -> torch.Tensor:
    """Keep the first dimensions[i] values of row i (Matryoshka truncation; zeros after), then
    L2-normalize if the model does — so a truncated embedding is renormalized."""
    keep = torch.arange(pooled.shape[1], device=pooled.device)[None] < dimensions[:, None]
    out = pooled * keep
    return F.normalize(out, dim=-1) if normalize else out
