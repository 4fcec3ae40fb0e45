"""Linear layers in the column- / row-parallel form of Megatron-LM.

Each parameter carries a ``weight_loader(param, loaded, shard_id=None)`` that copies this rank's
slice of a checkpoint tensor into place, so model files never slice weights themselves; the
layer's ``checkpoint_tensor(param, shard_id)`` is its inverse, the whole checkpoint tensor
gathered from every rank (get_weights_by_name; every rank must call it).
A column-parallel layer splits the output features across ranks; a row-parallel layer splits
the input features and sums the partial outputs with an all-reduce.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.distributed import all_gather_dim, all_reduce, divide, tp_rank, tp_size
from engine.quantization import building_fp8
from engine.quantization.fp8 import FP8, QuantizedRows, fp8_linear, quantize_weight_rows

if TYPE_CHECKING:
    from engine.lora.layer import LoraLinear


def _copy_checked(
    param: nn.Parameter, target: torch.Tensor, loaded: torch.Tensor, name: str
) -> None:
    if target.shape != loaded.shape:
        raise ValueError(
            f"shape mismatch for {name}: the checkpoint has {tuple(loaded.shape)}, the model expects {tuple(target.shape)}"
        )
    target.copy_(loaded)


class LinearBase(nn.Module):
    # the LoRA update of this projection, when the engine serves adapters (engine/lora/layer.py)
    lora: LoraLinear | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        fp8 = building_fp8()
        dtype = FP8 if fp8 is not None else None
        self.weight = self._param(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = self._param(torch.empty(out_features)) if bias else None
        self.weight_scale = self.input_scale = self.tensor_scale = None
        if fp8 is not None:
            self.weight_scale = self._param(torch.ones(out_features, dtype=torch.float32))
            # NOTE: quantized at load, the scales come with the weight, not from the checkpoint
            self.weight_scale.from_weight = not fp8.from_checkpoint
            if fp8.static_input:  # the largest of the fused projections' input scales
                self.input_scale = self._param(torch.zeros(1, dtype=torch.float32))
                if fp8.weight_per_tensor:
                    # the layer's one weight scale once loaded (finish_loading): with the static
                    # input_scale both scales are scalars, and the product runs on cuBLAS's
                    # tensor-wise kernels, as TensorRT-LLM runs such checkpoints
                    self.tensor_scale = torch.ones(1, dtype=torch.float32)

    def _param(self, data: torch.Tensor) -> nn.Parameter:
        param = nn.Parameter(data, requires_grad=False)
        param.weight_loader = self.weight_loader
        return param

    def takes_quantized_rows(self) -> bool:
        """Whether forward may be given QuantizedRows, written by the kernel before it: float8
        weights (activations per token, or with `input_scale` when the checkpoint has one), and
        no LoRA (whose update reads x itself)."""
        return self.weight_scale is not None and self.lora is None

    def matmul(self, x: torch.Tensor | QuantizedRows, bias: torch.Tensor | None) -> torch.Tensor:
        if self.weight_scale is None:
            return F.linear(x, self.weight, bias)
        scale = self.weight_scale if self.tensor_scale is None else self.tensor_scale
        return fp8_linear(x, self.weight, scale, bias, self.input_scale)

    @torch.no_grad()
    def finish_loading(self) -> None:
        """After every weight is in (a checkpoint, or dummy weights): a layer of per-tensor
        scales, whose fused projections (q, k, v; gate, up) each came with their own, has its
        rows requantized to the largest, which becomes `tensor_scale`. A row's values shrink by
        its scale over the largest (at most 1: nothing saturates) and round once more.
        NOTE: in place, so CUDA graphs that captured the weights stay valid on a reload."""
        if self.tensor_scale is None:
            return
        rows, weight = self.weight_scale.data, self.weight.data
        top = rows.max()
        for start in range(0, weight.shape[0], 4096):  # bounds the float32 copy
            part, ratio = weight[start : start + 4096], rows[start : start + 4096] / top
            part.copy_((part.float() * ratio[:, None]).to(FP8))
        rows.copy_(top.expand_as(rows))
        self.tensor_scale.copy_(top.reshape(1))

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        y = self.matmul(x, self.bias)
        return y if self.lora is None else self.lora.add_to(x, y)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None
    ) -> None:
        raise NotImplementedError

    def checkpoint_tensor(self, param: nn.Parameter, shard_id: object = None) -> torch.Tensor:
        raise NotImplementedError

    def _load_scale(self, param: nn.Parameter, loaded: torch.Tensor, rows: torch.Tensor) -> bool:
        """Scalar scales: an input_scale (the largest wins) or a per-tensor weight_scale
        (filling `rows`, the shard's rows). False for anything else."""
        if param is self.input_scale:
            param.data.copy_(torch.maximum(param.data, loaded.reshape(1).to(param.data)))
            return True
        if param is self.weight_scale and loaded.numel() == 1:
            rows.fill_(float(loaded.reshape(())))
            return True
        return False

    def _copy_weight(self, param: nn.Parameter, target: torch.Tensor, scales: torch.Tensor,
                     loaded: torch.Tensor, name: str) -> None:  # fmt: skip
        """Copy `loaded` into `target` (rows of `param`); a 16-bit weight into a float8 layer
        is quantized per row, its scales into `scales` (the same rows of weight_scale)."""
        if param is self.weight and self.weight_scale is not None and loaded.dtype != FP8:
            if target.shape != loaded.shape:
                _copy_checked(param, target, loaded, name)  # (raises, naming the shapes)
            loaded, row_scales = quantize_weight_rows(loaded)
            scales.copy_(row_scales)
        elif param is self.weight_scale:
            loaded = loaded.reshape(-1)  # ([N, 1] per channel, as compressed-tensors stores it)
        _copy_checked(param, target, loaded, name)


def finish_loading(model: nn.Module) -> None:
    """LinearBase.finish_loading on every linear layer of `model`, once its weights are in."""
    for module in model.modules():
        if isinstance(module, LinearBase):
            module.finish_loading()


class ColumnParallelLinear(LinearBase):
    """y = x W^T with W split along its output rows; each rank holds out_features / tp rows."""

    kv_replicas = 1  # ranks that hold the same rows (QKVParallelLinear's K and V with few heads)

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, divide(out_features, tp_size(), "output features"), bias)

    def shard_rows(self, shard_id: object) -> tuple[int, int]:
        """(first row, rows) of projection `shard_id` in this rank's (fused) weight."""
        return 0, self.weight.shape[0]

    def source_index(self, shard_id: object) -> int:
        """Which block of `rows` rows of the checkpoint tensor this rank holds."""
        return tp_rank()

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None
    ) -> None:
        offset, size = self.shard_rows(shard_id)
        name = type(self).__name__ + (f"[{shard_id}]" if shard_id is not None else "")
        fp8 = self.weight_scale is not None
        scales = self.weight_scale.data.narrow(0, offset, size) if fp8 else None
        if self._load_scale(param, loaded, scales):
            return
        if tp_size() > 1:
            loaded = loaded.narrow(0, self.source_index(shard_id) * size, size)
        self._copy_weight(param, param.data.narrow(0, offset, size), scales, loaded, name)

    def checkpoint_tensor(self, param: nn.Parameter, shard_id: object = None) -> torch.Tensor:
        if param is self.input_scale:
            return param.data
        offset, size = self.shard_rows(shard_id)
        gathered = all_gather_dim(param.data.narrow(0, offset, size), 0)
        if shard_id not in ("k", "v") or self.kv_replicas == 1:
            return gathered
        # each KV head is on kv_replicas ranks in a row: one copy of each
        return torch.cat(gathered.split(size)[:: self.kv_replicas])


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input in one matmul (gate and up of an MLP)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias)

    def shard_rows(self, shard_id: object) -> tuple[int, int]:
        assert isinstance(shard_id, int)
        size = self.output_sizes[shard_id] // tp_size()
        return sum(self.output_sizes[:shard_id]) // tp_size(), size


class QKVParallelLinear(ColumnParallelLinear):
    """The q, k and v projections of attention in one matmul, split by heads across ranks.

    NOTE: when there are fewer KV heads than ranks, each KV head is replicated on tp/num_kv_heads ranks.
    """

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ) -> None:
        tp = tp_size()
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp, "num_attention_heads")
        self.num_kv_heads = max(1, num_kv_heads // tp)
        self.kv_replicas = max(1, tp // num_kv_heads)
        if num_kv_heads >= tp:
            divide(num_kv_heads, tp, "num_key_value_heads")
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        LinearBase.__init__(self, hidden_size, out, bias)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def shard_rows(self, shard_id: object) -> tuple[int, int]:
        """(first row, rows) of projection `shard_id` ('q', 'k' or 'v') in this rank's weight."""
        if shard_id == "q":
            return 0, self.q_size
        if shard_id in ("k", "v"):
            return self.q_size + (self.kv_size if shard_id == "v" else 0), self.kv_size
        raise ValueError(f"QKVParallelLinear shard must be 'q', 'k' or 'v', got {shard_id!r}")

    def source_index(self, shard_id: object) -> int:
        return tp_rank() if shard_id == "q" else tp_rank() // self.kv_replicas


class RowParallelLinear(LinearBase):
    """y = x W^T with W split along its input columns; partial sums are all-reduced across ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(divide(in_features, tp_size(), "input features"), out_features, bias)

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        # NOTE: the bias is added once, after the reduction, not once per rank.
        y = all_reduce(self.matmul(x, None))
        y = y + self.bias if self.bias is not None else y
        return y if self.lora is None else self.lora.add_to(x, y)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None
    ) -> None:
        scales = self.weight_scale.data if self.weight_scale is not None else None
        if self._load_scale(param, loaded, scales):
            return
        if param.dim() == 2 and tp_size() > 1:
            cols = param.shape[1]
            loaded = loaded.narrow(1, tp_rank() * cols, cols)
        self._copy_weight(param, param.data, scales, loaded, type(self).__name__)

    def checkpoint_tensor(self, param: nn.Parameter, shard_id: object = None) -> torch.Tensor:
        return all_gather_dim(param.data, 1) if param.dim() == 2 else param.data
