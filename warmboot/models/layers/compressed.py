"""DeepSeek-V4's attention layer (``kernels.compressed_attention`` keeps its K = V and its
compressors' per-token rows in the paged cache, pools, selects and attends).

Names as DeepSeek's checkpoints (``wq_a``, ``q_norm``, ``wq_b``, ``wkv``, ``norm``, ``wo_a``,
``wo_b``, ``compressor.{wkv, wgate, ape, norm}``, ``indexer.{wq_b, weights_proj}`` and the
indexer's own ``indexer.compressor``); ``attn_sink`` is ``sinks``.
"""

from __future__ import annotations

import torch
from torch import nn

from warmboot.kernels import compressed_attention as ops
from warmboot.kernels.backend import AttentionSpec
from warmboot.models.layers.attention import Attend
from warmboot.models.layers.indexer import FloatProjection
from warmboot.models.layers.linear import Linear
from warmboot.models.layers.norm import RMSNorm
from warmboot.models.layers.rope import RotaryEmbedding


class Compressor(nn.Module):
    """Per token ``wkv`` and ``wgate`` (``series`` x ``dim`` each: two for CSA's overlapping
    windows); ``ape`` (rate, series * dim) and ``norm`` (dim) are applied when pooling."""

    def __init__(self, hidden: int, dim: int, rate: int, series: int, eps: float):
        super().__init__()
        self.wkv = Linear(hidden, series * dim)
        self.wgate = Linear(hidden, series * dim)
        self.ape = nn.Parameter(torch.empty(rate, series * dim))
        self.norm = RMSNorm(dim, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.wkv(x), self.wgate(x)], dim=-1)


class LightningIndexer(nn.Module):
    """``wq_b`` (query latent -> heads x dim, rotated on its last dims), ``weights_proj``
    (float32, times ``heads ** -0.5``) and a ``compressor`` of its own (``dim`` wide)."""

    def __init__(self, hidden: int, q_lora_rank: int, heads: int, dim: int, rate: int, eps):
        super().__init__()
        self.heads, self.dim = heads, dim
        self.wq_b = Linear(q_lora_rank, heads * dim)
        self.weights_proj = FloatProjection(hidden, heads)
        self.compressor = Compressor(hidden, dim, rate, 2, eps)


def _unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class CompressedAttention(nn.Module):
    """Low-rank queries (RMS-normed per head without weight), one K = V head, interleaved
    rope on the last ``rope.rotary_dim`` dims (undone on the output at the query's position),
    sinks, a sliding ``window``; ``rate`` > 0 adds compressed entries (``indexer``: CSA, else
    HCA); the output through ``o_groups`` grouped low-rank projections, then ``wo_b``."""

    calls_step_op = True

    def __init__(
        self,
        hidden: int,
        heads: int,
        head_dim: int,
        *,
        q_lora_rank: int,
        o_groups: int,
        o_lora_rank: int,
        rope: RotaryEmbedding,
        window: int,
        rate: int,
        indexer: LightningIndexer | None,
        topk: int,
        eps: float,
    ):
        super().__init__()
        self.heads, self.head_dim, self.groups, self.eps = heads, head_dim, o_groups, eps
        self.wq_a = Linear(hidden, q_lora_rank)
        self.q_norm = RMSNorm(q_lora_rank, eps)
        self.wq_b = Linear(q_lora_rank, heads * head_dim)
        self.wkv = Linear(hidden, head_dim)
        self.norm = RMSNorm(head_dim, eps)
        self.wo_a = nn.Parameter(torch.empty(o_groups * o_lora_rank, heads * head_dim // o_groups))
        self.wo_b = Linear(o_groups * o_lora_rank, hidden)
        self.sinks = nn.Parameter(torch.empty(heads))
        self.rope, self.rate, self.indexer = rope, rate, indexer
        series = 2 if indexer is not None else 1
        self.compressor = Compressor(hidden, head_dim, rate, series, eps) if rate else None
        self.spec = AttentionSpec(scale=head_dim**-0.5)
        self.how = (rate, indexer is not None, window, topk, eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        n, rope = x.shape[0], self.rope
        cos, sin = rope.cos[positions], rope.sin[positions]
        latent = self.q_norm(self.wq_a(x))
        q = _unit_rms(self.wq_b(latent).view(n, self.heads, self.head_dim), self.eps)
        q = ops.rope_last(q, cos.unsqueeze(1), sin.unsqueeze(1))
        kv = ops.rope_last(self.norm(self.wkv(x)), cos, sin)
        side, iq, iw = self._side(x, latent, cos, sin)
        params = self._params()
        o = ops.call_compressed(self, attend, q, kv, side, iq, iw, params, self.how)
        o = ops.rope_last(o, cos.unsqueeze(1), -sin.unsqueeze(1))
        grouped = o.reshape(n, self.groups, -1)
        weight = self.wo_a.view(self.groups, -1, grouped.shape[-1])
        mid = torch.einsum("ngi,gri->ngr", grouped, weight).flatten(1)
        return self.wo_b(mid)

    def _side(self, x, latent, cos, sin):
        """The compressor rows to cache, the indexer's queries and weights (empty where
        the layer has none)."""
        n, empty = x.shape[0], x.new_empty(x.shape[0], 0)
        if self.compressor is None:
            return empty, empty.unsqueeze(1), empty.float()
        rows = [self.compressor(x)]
        if self.indexer is None:
            return rows[0], empty.unsqueeze(1), empty.float()
        ix = self.indexer
        rows.append(ix.compressor(x))
        iq = ix.wq_b(latent).view(n, ix.heads, ix.dim)
        iq = ops.rope_last(iq, cos.unsqueeze(1), sin.unsqueeze(1))
        iw = ix.weights_proj(x) * ix.heads**-0.5
        return torch.cat(rows, dim=-1), iq, iw

    def _params(self) -> tuple[torch.Tensor, ...]:
        """(ape, norm, indexer ape, indexer norm, rope cos, rope sin) for the op."""
        none = self.rope.cos.new_empty(0)
        c = self.compressor
        ape, norm = (none, none) if c is None else (c.ape, c.norm.weight)
        i = None if self.indexer is None else self.indexer.compressor
        iape, inorm = (none, none) if i is None else (i.ape, i.norm.weight)
        return ape, norm, iape, inorm, self.rope.cos, self.rope.sin

    def side_width(self) -> int:
        """Compressor row width per token in the cache (0: window only)."""
        total = 0
        for c in (self.compressor, self.indexer and self.indexer.compressor):
            if c is not None:
                total += 2 * c.ape.shape[-1]
        return total
