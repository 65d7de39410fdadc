"""Per-layer input embeddings (PLE; Gemma 3n, Gemma 4): every token gets one small vector
(``width``) per decoder layer, and each layer adds a gated projection of its own to the
hidden state.

- ``PerLayerEmbedding`` (the model's): a token's row of a packed table (vocab, layers *
  width), scaled by sqrt(width), plus the embedding projected to layers * width (scaled by
  hidden ** -0.5, RMS-normed per layer), the sum scaled by 2 ** -0.5: (N, layers, width).
- ``PerLayerInput`` (each decoder layer's): ``norm(proj(act(gate(x)) * per_layer_input))``,
  (N, hidden), which the family adds where its layer does.

A decoder layer is called as ``layer(x, positions, attend)`` (the compiled step's region), so
the family hands a layer its slice in the same row: ``layer_row`` appends it to the hidden
state, ``split_row`` takes it off again. Checkpoint names: ``PER_LAYER_RENAMES`` (the model
keeps its ``PerLayerEmbedding`` as ``per_layer_embedding``, a layer its ``PerLayerInput`` as
``per_layer``)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from warmboot.models.layers.activation import activation
from warmboot.models.layers.linear import Linear

PER_LAYER_RENAMES = (
    (
        r"^(embed_tokens_per_layer|per_layer_model_projection|per_layer_projection_norm)\.",
        r"per_layer_embedding.\1.",
    ),
    (
        r"\.(per_layer_input_gate|per_layer_projection|post_per_layer_input_norm)\.",
        r".per_layer.\1.",
    ),
)
"""Checkpoint names (after ``model.`` is dropped) -> ours: append to a family's ``renames``."""


@functools.cache
def _rounded(value: float, dtype: torch.dtype) -> float:
    """``value`` as float32 holds it, then ``dtype`` (a float32 scale tensor cast to it)."""
    return torch.tensor(value, dtype=torch.float32, device="cpu").to(dtype).item()


class PerLayerEmbedding(nn.Module):
    """(N,) ids and their (N, hidden) embeddings -> (N, layers, width) per-layer inputs.

    ``make_norm(width)``: the family's RMSNorm over each layer's slice. Ids outside the table
    read row 0 (Gemma 3n; a family whose reference fails on them refuses such a table at load).
    ``float_scales``: the projection and sum scales multiply as Python floats (Gemma 4), not
    as float32 tensors cast to the activations' dtype first (Gemma 3n); alike in float32."""

    def __init__(
        self,
        vocab: int,
        num_layers: int,
        width: int,
        hidden: int,
        make_norm: Callable[[int], nn.Module],
        float_scales: bool = False,
    ):
        super().__init__()
        self.vocab, self.num_layers, self.width, self.hidden = vocab, num_layers, width, hidden
        weight = torch.empty(vocab, num_layers * width)
        self.embed_tokens_per_layer = nn.Embedding(vocab, num_layers * width, _weight=weight)
        self.per_layer_model_projection = Linear(hidden, num_layers * width)
        self.per_layer_projection_norm = make_norm(width)
        self.float_scales = float_scales

    def forward(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        n, dtype = input_ids.shape[0], embeds.dtype
        ids = torch.where((input_ids >= 0) & (input_ids < self.vocab), input_ids, 0)
        table = self.embed_tokens_per_layer(ids) * _rounded(self.width**0.5, dtype)
        proj_scale, sum_scale = self.hidden**-0.5, 2.0**-0.5
        if not self.float_scales:
            proj_scale, sum_scale = _rounded(proj_scale, dtype), _rounded(sum_scale, dtype)
        proj = self.per_layer_model_projection(embeds) * proj_scale
        proj = self.per_layer_projection_norm(proj.reshape(n, self.num_layers, self.width))
        return (proj + table.reshape(n, self.num_layers, self.width)) * sum_scale


class PerLayerInput(nn.Module):
    """A decoder layer's use of its per-layer input: ``x`` (N, hidden) gated down to the
    input's width, ``act`` applied, times the input, projected back and normed."""

    def __init__(self, hidden: int, width: int, act: str, norm: nn.Module):
        super().__init__()
        self.per_layer_input_gate = Linear(hidden, width)
        self.per_layer_projection = Linear(width, hidden)
        self.post_per_layer_input_norm = norm
        self.act = activation(act)

    def forward(self, x: torch.Tensor, per_layer_input: torch.Tensor) -> torch.Tensor:
        gated = self.act(self.per_layer_input_gate(x)) * per_layer_input
        return self.post_per_layer_input_norm(self.per_layer_projection(gated))


def layer_row(x: torch.Tensor, per_layer: torch.Tensor | None, index: int) -> torch.Tensor:
    """Layer ``index``'s input row: ``x`` (N, D) then its per-layer input (N, width)."""
    return x if per_layer is None else torch.cat((x, per_layer[:, index]), dim=-1)


def split_row(row: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``layer_row``'s row back into the hidden state and the per-layer input (None: 0 wide)."""
    if not width:
        return row, None
    return row[:, :-width], row[:, -width:]


def per_layer_rows(per_layer: torch.Tensor | None):
    """``decoder.run_layers``' ``row``: each layer's ``layer_row``."""
    return lambda i, x: layer_row(x, per_layer, i)
