"""Multi-head latent attention (MLA, DeepSeek-V2/V3) in its absorbed form over a latent cache.

A token's keys and values come from one compressed latent ``c`` (``kv_lora_rank`` wide,
normed) expanded per head by ``kv_b_proj``, plus one rotated key part ``k_pe`` shared by the
heads. The cache holds per token and layer just ``[c, k_pe]``: one "head" of
``kv_lora_rank + qk_rope_head_dim``. With ``kv_b_proj``'s weight viewed (H, nope + v, r) as
``W_UK`` (H, nope, r) and ``W_UV`` (H, v, r), per head

    q.k = q_nope . (W_UK c) + q_pe . k_pe = [q_nope W_UK, q_pe] . [c, k_pe]
    out = sum_j p_j W_UV c_j = W_UV (sum_j p_j c_j)

so the step's ordinary attention runs as MQA (one KV head) with the query
``[q_nope W_UK, q_pe]`` and the cached ``[c, k_pe]`` as both keys and values: the output's
first r dims are the attention-weighted latent (its last rope dims are discarded), which
``W_UV`` expands per head before ``o_proj``. No backend needs an MLA kernel.

KV bytes per token per layer, DeepSeek-V3 (kv_lora_rank 512, rope 64, 128 heads, nope 128,
v 128), bf16: the latent cache holds 512 + 64 = 576 values (1152 B); full K and V would hold
128 * (128 + 64) + 128 * 128 = 40960 values (81920 B): 71x more.
"""

from __future__ import annotations

import torch
from torch import nn

from warmboot.kernels.backend import AttentionSpec, KVLayout
from warmboot.models.layers.attention import Attend
from warmboot.models.layers.linear import Linear
from warmboot.models.layers.norm import RMSNorm
from warmboot.models.layers.rope import RotaryEmbedding

LATENT_NORM_EPS = 1e-6
"""The q/kv latent norms' epsilon: DeepSeek builds them without the config's ``rms_norm_eps``."""


class LatentProjection(nn.Module):
    """``kv_b_proj``'s weight (H * (nope + v), r), read per head by ``MLAttention``: a plain
    holder, not a ``Linear`` (the compiled step packs every ``Linear`` for a GEMM; this
    weight is split into two batched products instead)."""

    def __init__(self, rank: int, num_heads: int, nope: int, v: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_heads * (nope + v), rank))
        self.num_heads, self.nope, self.v = num_heads, nope, v

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK (H, nope, r), W_UV (H, v, r))."""
        w = self.weight.view(self.num_heads, self.nope + self.v, -1)
        return w[:, : self.nope], w[:, self.nope :]

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, nope={self.nope}, v={self.v}, rank={self.weight.shape[1]}"


class MLAttention(nn.Module):
    """DeepSeek's attention: q through ``q_proj`` or the low-rank ``q_a_proj`` ->
    ``q_a_layernorm`` -> ``q_b_proj``; the latent through ``kv_a_proj_with_mqa`` ->
    ``kv_a_layernorm``; rope on the last ``rope_dim`` dims of each query head and on the
    shared ``k_pe``; absorbed attention over the latent cache (module docstring)."""

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        *,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        nope_dim: int,
        rope_dim: int,
        v_dim: int,
        rope: RotaryEmbedding,
        spec: AttentionSpec,
        bias: bool = False,
    ):
        super().__init__()
        self.num_heads, self.rank = num_heads, kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = nope_dim, rope_dim, v_dim
        q_out = num_heads * (nope_dim + rope_dim)
        if q_lora_rank is None:
            self.q_proj = Linear(hidden, q_out)
        else:
            self.q_a_proj = Linear(hidden, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(q_lora_rank, q_out)
        self.q_lora_rank = q_lora_rank
        self.kv_a_proj_with_mqa = Linear(hidden, kv_lora_rank + rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = LatentProjection(kv_lora_rank, num_heads, nope_dim, v_dim)
        self.o_proj = Linear(num_heads * v_dim, hidden, bias=bias)
        self.rope, self.spec = rope, spec

    def kv_layout(self) -> KVLayout:
        """One cache entry per token: the latent and the rotated key part, as one head."""
        return KVLayout(1, 1, self.rank + self.rope_dim)

    def query_latent(self, x: torch.Tensor) -> torch.Tensor:
        """The normed low-rank query latent (``x`` itself without ``q_lora_rank``)."""
        if self.q_lora_rank is None:
            return x
        return self.q_a_layernorm(self.q_a_proj(x))

    def query(self, latent: torch.Tensor) -> torch.Tensor:
        return self.q_proj(latent) if self.q_lora_rank is None else self.q_b_proj(latent)

    def latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed latent c (N, r), unrotated k_pe (N, rope))."""
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        return self.kv_a_layernorm(c), k_pe

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        q_latent = self.query_latent(x)
        q = self.query(q_latent).view(x.shape[0], self.num_heads, self.nope_dim + self.rope_dim)
        return self.project_out(x, self.attend_heads(x, q, q_latent, positions, attend))

    def attend_heads(self, x, q, q_latent, positions, attend: Attend) -> torch.Tensor:
        """The heads' outputs (N, H, v) of queries ``q`` (N, H, nope + rope), unrotated."""
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        c, k_pe = self.latent(x)
        q_pe, k_pe = self.rope(positions, q_pe, k_pe.unsqueeze(1))
        w_uk, w_uv = self.kv_b_proj.absorbed()
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # (N, H, r)
        entry = torch.cat([c.unsqueeze(1), k_pe], dim=-1)  # (N, 1, r + rope)
        query = torch.cat([q_lat, q_pe], dim=-1)
        out = self.attend_latent(attend, query, entry, x, q_latent, positions)  # (N, H, r + rope)
        o = torch.bmm(out[..., : self.rank].transpose(0, 1), w_uv.transpose(1, 2))  # (H, N, v)
        return o.transpose(0, 1)

    def attend_latent(self, attend: Attend, query, entry, x, q_latent, positions) -> torch.Tensor:
        """The absorbed query over the latent cache (the step's attention; an indexed layer
        selects the positions first)."""
        return attend(query, entry, entry)

    def project_out(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """The heads' outputs ``o`` (N, H, v) through ``o_proj`` (a gated variant gates them
        by ``x`` first)."""
        return self.o_proj(o.reshape(o.shape[0], self.num_heads * self.v_dim))
