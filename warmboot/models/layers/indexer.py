"""Lightning indexers and the attention that uses them (``kernels.sparse_attention`` keeps
their keys in the paged cache and attends over what they select).

- DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): per token ``index_n_heads`` queries from
  the attention's low-rank query latent, one key from the hidden state (LayerNorm), their first
  ``rope_dim`` dims rotated, and per-head weights; each query attends to its ``index_topk``
  best positions (``IndexedMLAttention``).
- MiniMax-M3: one query per KV head and one key, normed and rotated; each KV head's queries
  attend to the best ``index_topk_blocks`` blocks of positions (``BlockIndexedAttention``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from warmboot.kernels import sparse_attention
from warmboot.models.layers.attention import Attend, Attention
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
    interleaved in GLM-5), the last ones with ``rope_last`` (HY-V4). ``norm_eps``,
    ``norm_upcast``: the key norm's epsilon, and whether it runs in float32 (HY-V4)."""

    def __init__(
        self,
        hidden: int,
        q_lora_rank: int,
        heads: int,
        dim: int,
        rope: RotaryEmbedding,
        *,
        rope_last: bool = False,
        norm_eps: float = INDEX_NORM_EPS,
        norm_upcast: bool = False,
    ):
        super().__init__()
        self.heads, self.dim, self.rope = heads, dim, rope
        self.rope_dim, self.rope_last = rope.rotary_dim, rope_last
        self.wq_b = Linear(q_lora_rank, heads * dim)
        self.wk = Linear(hidden, dim)
        self.k_norm = LayerNorm(dim, norm_eps, upcast=norm_upcast)
        self.weights_proj = FloatProjection(hidden, heads)

    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor):
        """(queries (N, H, D), key (N, D), weights (N, H) float32)."""
        n, r = x.shape[0], self.rope_dim
        q = self.wq_b(q_latent).view(n, self.heads, self.dim)
        k = self.k_norm(self.wk(x)).unsqueeze(1)
        if self.rope_last:
            q_pass, q_rot = q.split([self.dim - r, r], dim=-1)
            k_pass, k_rot = k.split([self.dim - r, r], dim=-1)
            q_rot, k_rot = self.rope(positions, q_rot, k_rot)
            q, k = torch.cat([q_pass, q_rot], dim=-1), torch.cat([k_pass, k_rot], dim=-1)
        else:
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
        how = (self.topk, 0, 0, self.indexer is None)
        return sparse_attention.call_indexed(self, attend, query, entry, entry, iq, ik, iw, how)


class BlockIndexer(nn.Module):
    """MiniMax-M3's indexer: ``wq`` (hidden -> one query per KV head), ``wk`` (hidden -> one
    key; a checkpoint's ``q_proj`` / ``k_proj``, renamed apart from the attention's stacked
    q/k/v), each normed (``norm``), rotated by the attention's ``rope`` (its first rotary
    dims); no weights: ``kernels.sparse_attention.select_blocks`` scores blocks."""

    def __init__(self, hidden: int, heads: int, dim: int, norm, rope: RotaryEmbedding):
        super().__init__()
        self.heads, self.dim, self.rope = heads, dim, rope
        self.wq = Linear(hidden, heads * dim)
        self.wk = Linear(hidden, dim)
        self.q_norm, self.k_norm = norm(dim), norm(dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor):
        """(queries (N, G, D), key (N, D), an empty weight (N, 0))."""
        n = x.shape[0]
        q = self.q_norm(self.wq(x).view(n, self.heads, self.dim))
        k = self.k_norm(self.wk(x)).unsqueeze(1)
        q, k = self.rope(positions, q, k)
        return q, k.squeeze(1), x.new_empty(n, 0, dtype=torch.float32)


class BlockIndexedAttention(Attention):
    """``Attention`` over the key blocks its ``indexer`` picks per KV head: ``topk`` blocks
    of ``block`` positions, the ``local`` ones ending at the query's always among them."""

    calls_step_op = True

    def __init__(self, *args, indexer: BlockIndexer, topk: int, block: int, local: int, **kw):
        super().__init__(*args, **kw)
        self.indexer, self.how = indexer, (topk, block, local, False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        iq, ik, iw = self.indexer(x, positions)

        def indexed(q, k, v):
            return sparse_attention.call_indexed(self, attend, q, k, v, iq, ik, iw, self.how)

        return super().forward(x, positions, indexed)
