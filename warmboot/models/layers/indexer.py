"""DeepSeek Sparse Attention's lightning indexer and the latent attention that uses it
(DeepSeek-V3.2, GLM-5): per token the indexer gives ``index_n_heads`` queries from the
attention's low-rank query latent, one key from the hidden state (LayerNorm), their first
``rope_dim`` dims rotated, and per-head weights; ``kernels.sparse_attention`` keeps the keys in
the paged cache and attends over each query's ``index_topk`` best positions."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from warmboot.kernels import sparse_attention
from warmboot.models.layers.attention import Attend
from warmboot.models.layers.linear import Linear
from warmboot.models.layers.mla import MLAttention
from warmboot.models.layers.norm import LayerNorm
from warmboot.models.layers.rope import RotaryEmbedding

INDEX_NORM_EPS = 1e-6
"""The indexer key norm's epsilon (built without the config's)."""


class FloatProjection(nn.Module):
    """A bias-free projection computed in float32 from its weight as stored (transformers
    keeps the indexer's ``weights_proj`` in float32): a holder, not a ``Linear``, so the
    compiled step leaves it out of its packed bf16 GEMMs."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())


class Indexer(nn.Module):
    """``wq_b`` (query latent -> H x D), ``wk`` + ``k_norm`` (hidden -> one D key),
    ``weights_proj`` (hidden -> H weights, scaled by ``H ** -0.5``); ``rope`` rotates the
    first ``rope_dim`` dims of queries and key (its own pairing: half-split in V3.2,
    interleaved in GLM-5)."""

    def __init__(self, hidden: int, q_lora_rank: int, heads: int, dim: int, rope: RotaryEmbedding):
        super().__init__()
        self.heads, self.dim, self.rope = heads, dim, rope
        self.rope_dim = rope.rotary_dim
        self.wq_b = Linear(q_lora_rank, heads * dim)
        self.wk = Linear(hidden, dim)
        self.k_norm = LayerNorm(dim, INDEX_NORM_EPS)
        self.weights_proj = FloatProjection(hidden, heads)

    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor):
        """(queries (N, H, D), key (N, D), weights (N, H) float32)."""
        n, r = x.shape[0], self.rope_dim
        q = self.wq_b(q_latent).view(n, self.heads, self.dim)
        k = self.k_norm(self.wk(x)).unsqueeze(1)
        q_rot, k_rot = self.rope(positions, q[..., :r], k[..., :r])
        q = torch.cat([q_rot, q[..., r:]], dim=-1)
        k = torch.cat([k_rot, k[..., r:]], dim=-1)
        return q, k.squeeze(1), self.weights_proj(x) * self.heads**-0.5


class IndexedMLAttention(MLAttention):
    """``MLAttention`` over each query's ``topk`` positions chosen by its ``indexer``; with
    ``indexer`` None the layer takes the selection of the step's last indexing layer (GLM-5's
    ``shared`` layers)."""

    calls_step_op = True

    def __init__(self, *args, indexer: Indexer | None, topk: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.indexer, self.topk = indexer, topk

    def attend_latent(self, attend: Attend, query, entry, x, q_latent, positions) -> torch.Tensor:
        if self.indexer is None:
            empty = x.new_empty(x.shape[0], 0)
            iq, ik, iw = empty.unsqueeze(1), empty, empty.float()
        else:
            iq, ik, iw = self.indexer(x, q_latent, positions)
        reuse = self.indexer is None
        return sparse_attention.call_indexed(
            self, attend, query, entry, entry, iq, ik, iw, self.topk, reuse
        )
