"""Phi-MoE (Phi-3.5-MoE): Mixtral's layers (every layer windowed when ``sliding_window``)
with LayerNorms (biased), q/k/v/o biases with ``attention_bias``, a head biased with
``lm_head_bias``, and two things of its own:

- sparsemixer routing (inference form): the best expert, weighted by a softmax over the
  experts whose logit lies within ``2 * router_jitter_noise`` (relative) of it; then the
  best of the others, weighted the same way among them. Always two experts, whatever
  ``num_experts_per_tok`` says (as transformers).
- longrope read its way: the frequencies are always the short factors; cos and sin are
  scaled by ``short_mscale`` or ``long_mscale`` by the sequence's length (a forward's
  largest position + 1, past ``original_max_position_embeddings``: long). Other scaled
  rope types are refused.
"""

from __future__ import annotations

import torch
from torch import nn

from warmboot.architectures import UnsupportedModelError
from warmboot.models.layers.moe import FusedExperts, Router, SparseMoE
from warmboot.models.layers.norm import LayerNorm
from warmboot.models.layers.rope import RopeSpec, RotaryEmbedding, longrope_rows
from warmboot.models.mixtral import MixtralForCausalLM


class SparsemixerRouter(Router):
    """Phi-MoE's top-2: ``select`` as sparsemixer outside training."""

    def __init__(self, hidden: int, num_experts: int, jitter_eps: float):
        super().__init__(hidden, num_experts, 2)
        self.jitter_eps = jitter_eps

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        first, w1 = self._pick(logits, logits)
        second, w2 = self._pick(logits.scatter(-1, first, float("-inf")), logits)
        return torch.cat((w1, w2), dim=-1), torch.cat((first, second), dim=-1)

    def _pick(self, scores: torch.Tensor, logits: torch.Tensor):
        """The best of ``scores``, and its softmax weight among the ``scores`` whose logit
        is within the relative jitter of the best."""
        best, ids = scores.max(dim=-1, keepdim=True)
        factor = logits.abs().clamp(min=best)
        gates = scores.masked_fill((best - logits) / factor > 2 * self.jitter_eps, float("-inf"))
        return ids, torch.softmax(gates, dim=-1).gather(-1, ids)


class PhimoeRotaryEmbedding(RotaryEmbedding):
    """Longrope rows (``longrope_rows``: by position and sequence length) of the short
    frequencies, scaled by the short or long ``mscale``."""

    def build(self, max_positions: int, dtype: torch.dtype, device: torch.device) -> None:
        spec = self.spec
        if spec.rope_type != "longrope":
            return super().build(max_positions, dtype, device)
        positions, lengths = longrope_rows(spec, max_positions)
        long = lengths > spec.get("original_max_position_embeddings")
        scale = torch.where(long, spec.get("long_mscale"), spec.get("short_mscale"))[:, None]
        dim = self.rotary_dim
        shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        factors = torch.tensor(spec.get("short_factor"), dtype=torch.float32)
        inv_freq = 1.0 / (factors * spec.theta**shape)
        self.rows, self.dtype = max_positions, dtype
        self.cos, self.sin = self._cos_sin(positions.float()[:, None] * inv_freq, scale)
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)


class PhimoeForCausalLM(MixtralForCausalLM):
    renames = (*MixtralForCausalLM.renames, (r"\.mlp\.router\.", ".mlp.gate."))
    rope_class = PhimoeRotaryEmbedding

    def make_norm(self, size: int | tuple[int, ...]) -> nn.Module:
        return LayerNorm(size, self.cfg.get("rms_norm_eps", 1e-5))

    def head_bias(self) -> bool:
        return bool(self.cfg.get("lm_head_bias", False))

    def rope_spec(self, **overrides) -> RopeSpec:
        cfg = self.cfg
        params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        kind = params.get("rope_type", params.get("type")) or "default"
        if kind not in ("default", "longrope"):
            raise UnsupportedModelError(
                f"Phi-MoE with rope_type {kind!r}: default or longrope only"
            )
        if kind == "longrope":  # NOTE: transformers: the top-level field wins, else the limit
            params["original_max_position_embeddings"] = (
                cfg.get("original_max_position_embeddings")
                or params.get("original_max_position_embeddings")
                or cfg.max_position_embeddings
            )
        kwargs = dict(
            theta=cfg.get("rope_theta", 1e6), max_position_embeddings=cfg.max_position_embeddings
        )
        return RopeSpec.parse(params, **(kwargs | overrides))

    def make_mlp(self, index: int) -> nn.Module:
        cfg = self.cfg
        experts, hidden = cfg.get("num_local_experts", 16), cfg.hidden_size
        return SparseMoE(
            SparsemixerRouter(hidden, experts, cfg.get("router_jitter_noise", 0.01)),
            FusedExperts(
                experts, hidden, cfg.get("intermediate_size"), cfg.get("hidden_act", "silu")
            ),
        )
