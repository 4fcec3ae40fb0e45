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
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        return y if self.lora is None else self.lora.add_to(x, y)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None
    ) -> None:
        raise NotImplementedError

    def checkpoint_tensor(self, param: nn.Parameter, shard_id: object = None) -> torch.Tensor:
        raise NotImplementedError


class ColumnParallelLinear(LinearBase):
    """y = x W^T with W split along its output rows; each rank holds out_features / tp rows."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, divide(out_features, tp_size(), "output features"), bias)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None
    ) -> None:
        rows = param.shape[0]
        _copy_checked(
            param,
            param.data,
            loaded.narrow(0, tp_rank() * rows, rows) if tp_size() > 1 else loaded,
            type(self).__name__,
        )

    def checkpoint_tensor(self, param: nn.Parameter, shard_id: object = None) -> torch.Tensor:
        return all_gather_dim(param.data, 0)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input in one matmul (gate and up of an MLP)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias)

    def shard_rows(self, shard_id: object) -> tuple[int, int]:
        """(first row, rows) of projection `shard_id` in this rank's fused weight."""
        assert isinstance(shard_id, int)
        size = self.output_sizes[shard_id] // tp_size()
        return sum(self.output_sizes[:shard_id]) // tp_size(), size

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None
    ) -> None:
        offset, size = self.shard_rows(shard_id)
        if tp_size() > 1:
            loaded = loaded.narrow(0, tp_rank() * size, size)
        _copy_checked(
            param, param.data.narrow(0, offset, size), loaded, f"{type(self).__name__}[{shard_id}]"
        )

    def checkpoint_tensor(self, param: nn.Parameter, shard_id: object = None) -> torch.Tensor:
        offset, size = self.shard_rows(shard_id)
        return all_gather_dim(param.data.narrow(0, offset, size), 0)


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

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None
    ) -> None:
        offset, size = self.shard_rows(shard_id)
        index = tp_rank() if shard_id == "q" else tp_rank() // self.kv_replicas
        if tp_size() > 1:
            loaded = loaded.narrow(0, index * size, size)
        _copy_checked(
            param, param.data.narrow(0, offset, size), loaded, f"{type(self).__name__}[{shard_id}]"
        )

    def checkpoint_tensor(self, param: nn.Parameter, shard_id: object = None) -> torch.Tensor:
        offset, size = self.shard_rows(shard_id)
        gathered = all_gather_dim(param.data.narrow(0, offset, size), 0)
        if shard_id == "q" or self.kv_replicas == 1:
            return gathered
        # each KV head is on kv_replicas ranks in a row: one copy of each
        return torch.cat(gathered.split(size)[:: self.kv_replicas])


class RowParallelLinear(LinearBase):
    """y = x W^T with W split along its input columns; partial sums are all-reduced across ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(divide(in_features, tp_size(), "input features"), out_features, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: the bias is added once, after the reduction, not once per rank.
        y = all_reduce(F.linear(x, self.weight))
        y = y + self.bias if self.bias is not None else y
        return y if self.lora is None else self.lora.add_to(x, y)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None
    ) -> None:
        if param.dim() == 2 and tp_size() > 1:
            cols = param.shape[1]
            loaded = loaded.narrow(1, tp_rank() * cols, cols)
        _copy_checked(param, param.data, loaded, type(self).__name__)

    def checkpoint_tensor(self, param: nn.Parameter, shard_id: object = None) -> torch.Tensor:
        return all_gather_dim(param.data, 1) if param.dim() == 2 else param.data
