"""One parameterised decoder for Llama, Qwen2, Qwen3 and Mistral over a paged KV cache.

Tokens of a step arrive flattened (N,); q/k/v projections and gate/up projections are fused at
load time (``models.loader``), so a layer runs four matmuls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from warmboot.config import ModelConfig
from warmboot.kernels.backend import AttentionBackend, AttentionMetadata
from warmboot.models.rope import apply_rope


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 and cast back, as the HF reference does."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.cfg = cfg
        self.sliding_window = cfg.sliding_windows[index]
        qkv_out = cfg.q_size + 2 * cfg.kv_size
        self.qkv_proj = nn.Linear(cfg.hidden_size, qkv_out, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.input_layernorm = nn.Parameter(torch.empty(cfg.hidden_size))
        self.post_attention_layernorm = nn.Parameter(torch.empty(cfg.hidden_size))
        if cfg.qk_norm:
            self.q_norm = nn.Parameter(torch.empty(cfg.head_dim))
            self.k_norm = nn.Parameter(torch.empty(cfg.head_dim))

    def forward(
        self,
        x: torch.Tensor,  # (N, hidden)
        cos: torch.Tensor,  # (N, head_dim)
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        n = x.shape[0]
        h = rms_norm(x, self.input_layernorm, eps)
        q, k, v = self.qkv_proj(h).split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(n, cfg.num_heads, cfg.head_dim)
        k = k.view(n, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(n, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = rms_norm(q, self.q_norm, eps), rms_norm(k, self.k_norm, eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = attn.forward(q, k, v, kv[0], kv[1], meta, cfg.head_dim**-0.5, self.sliding_window)
        x = x + self.o_proj(o.view(n, cfg.q_size))
        h = rms_norm(x, self.post_attention_layernorm, eps)
        gate, up = self.gate_up_proj(h).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # NOTE: an explicit (uninitialised) weight skips Embedding's normal_ init, which on the
        # meta device imports torch._dynamo: 1-1.6 s of every cold boot.
        weight = torch.empty(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.empty(cfg.hidden_size))
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.head: nn.Module | None = None
        """The LM head as a module of its own, when set (a compiled step's packed twin)."""
        self.rope_cos: torch.Tensor | None = None  # (max_positions, head_dim), set by the loader
        self.rope_sin: torch.Tensor | None = None

    def forward(
        self,
        input_ids: torch.Tensor,  # (N,)
        positions: torch.Tensor,  # (N,)
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        attn: AttentionBackend,
    ) -> torch.Tensor:  # (N, hidden), final-normed
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv, meta, attn)
        return rms_norm(x, self.norm, self.cfg.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(M, hidden) -> (M, vocab) float32."""
        if self.head is not None:
            return self.head(hidden).float()
        weight = self.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight
        return F.linear(hidden, weight).float()
