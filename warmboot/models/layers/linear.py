"""Linear layers whose computation is delegated to a *linear method*.

A ``Linear`` owns its parameters; its ``method`` decides how ``x @ W.T + b`` is computed.
Full precision (``DenseMethod``) is the default; the compiled CPU step swaps in
``PackedMethod`` (oneDNN-prepacked weights, ``kernels.step_ops``); quantized weights are
``QuantMethod`` (``layers.quant_linear``). A method may create its own parameters
(``create_weights``), takes them from the loader (``loaded``) and is the only code that reads
them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from warmboot.kernels.lora_op import lora_apply

LORA_INDEX = "lora_index"


class LinearMethod:
    """How a ``Linear`` computes. Subclasses override ``apply`` (and ``create_weights`` when
    their weights are not one dense matrix)."""

    packable = True
    """Whether a compiled CPU step packs its weight into its own GEMM's layout (``PackedMethod``);
    a quantized method keeps computing itself."""

    def create_weights(self, layer: Linear, bias: bool) -> None:
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features))
        layer.bias = nn.Parameter(torch.empty(layer.out_features)) if bias else None

    def loaded(self, layer: Linear, leaf: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor for parameter ``leaf`` in the layout the method computes from."""
        return tensor

    def join_shards(self, layer: Linear, leaf: str, parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(parts)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class DenseMethod(LinearMethod):
    """Full precision: ``F.linear`` on the layer's own weight and bias."""

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


DENSE = DenseMethod()


class PackedMethod(LinearMethod):
    """Slot ``slot`` of its decoder layer's packed weights, looked up in the bound step
    (``kernels.step_ops.packed_linear``): the compiled CPU step's GEMM. The ``Linear``
    carries its decoder layer's number as the buffer ``step_index``."""

    def __init__(self, slot: int):
        self.slot = slot

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.warmboot.packed_linear(x, layer.step_index, self.slot, layer.out_features)

    def gated(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of this stacked gate/up projection (``packed_gated``)."""
        return torch.ops.warmboot.packed_gated(x, layer.step_index, self.slot, layer.out_features)


class Linear(nn.Module):
    """``y = x @ W.T + b`` through ``method``. ``shards``: the output sizes of checkpoint
    tensors stacked into this one (q/k/v, gate/up), in order; the loader concatenates them."""

    def __init__(
        self,
        in_features: int,
        out_features: int | list[int],
        bias: bool = False,
        method: LinearMethod = DENSE,
    ):
        super().__init__()
        shards = list(out_features) if isinstance(out_features, list) else [out_features]
        self.in_features, self.out_features = in_features, sum(shards)
        self.shards = tuple(shards)
        self.method = method
        method.create_weights(self, bias)
        self.register_buffer(LORA_INDEX, None, persistent=False)
        """With LoRA on (``lora.targets``): this linear's number among the adaptable ones."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x)
        if self.lora_index is None:
            return y
        if torch.compiler.is_compiling():  # NOTE: opaque to the graph: adapters never recompile
            return torch.ops.warmboot.lora_linear(y, x, self.lora_index)
        return lora_apply(y, x, self.lora_index)

    def shard_count(self, leaf: str) -> int:
        """How many checkpoint tensors make up parameter ``leaf`` (the loader's stacking)."""
        return len(self.shards)

    def join_shards(self, leaf: str, parts: list[torch.Tensor]) -> torch.Tensor:
        return self.method.join_shards(self, leaf, parts)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {list(self.shards)}, bias={self.bias is not None}"
