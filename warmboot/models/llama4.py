"""Llama 4 text (``Llama4ForCausalLM``, model type ``llama4_text``): rope layers and NoPE
layers (``no_rope_layers``: 1 rotates, 0 does not; by default every
``no_rope_layer_interval``-th layer is NoPE). Rope is the complex (interleaved-pair) form,
then on rope layers an L2 norm without weights of each q and k head (``use_qk_norm``). The
``chunked_attention`` layers of ``layer_types`` (by default the rope layers) attend within
chunks of ``attention_chunk_size`` positions (``AttentionSpec.chunk``), the others causally
in full. NoPE layers with ``attn_temperature_tuning`` scale their queries by
``1 + attn_scale * log(1 + floor((position + 1) / floor_scale))``. The ``moe_layers`` (by
default every ``interleave_moe_layer_step``-th) route each token to its top-k experts by the
router's logits, each expert running on the token times the sigmoid of its logit (the input
scaled, not the output), plus a shared expert; the other layers are dense MLPs of
``intermediate_size_mlp``."""

from __future__ import annotations

import torch
from torch import nn

from warmboot.architectures import UnsupportedModelError
from warmboot.config import ModelConfig
from warmboot.kernels.backend import AttentionSpec
from warmboot.models.layers.activation import GatedMLP
from warmboot.models.layers.decoder import DecoderLayer
from warmboot.models.layers.moe import FusedExperts, Router, SparseMoE
from warmboot.models.layers.norm import RMSNorm
from warmboot.models.layers.rope import LENGTH_SHIFT, RopeSpec, RotaryEmbedding
from warmboot.models.llama import LlamaForCausalLM

CHUNKED, FULL = "chunked_attention", "full_attention"


class NormedRope(RotaryEmbedding):
    """The interleaved rotation, then (``eps`` given) each q and k head divided by its root
    mean square in float32, no weight (``use_qk_norm`` on rope layers)."""

    def __init__(self, spec: RopeSpec, head_dim: int, eps: float | None = None):
        super().__init__(spec, head_dim)
        self.eps = eps

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = super().forward(positions, q, k)
        if self.eps is None:
            return q, k
        return _l2_norm(q, self.eps), _l2_norm(k, self.eps)


def _l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class TemperatureTuning(nn.Module):
    """A NoPE layer's query scale by position (``attn_temperature_tuning``); k as it is."""

    def __init__(self, floor_scale: float, attn_scale: float):
        super().__init__()
        self.floor_scale, self.attn_scale = floor_scale, attn_scale

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pos = (positions & ((1 << LENGTH_SHIFT) - 1)).float()
        scale = torch.log1p(torch.floor((pos + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
        return (q * scale[:, None, None]).to(q.dtype), k


class Llama4Router(Router):
    """The top-k experts by logit, each weighted by the sigmoid of its logit."""

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, ids = logits.topk(self.top_k, dim=-1)
        return top.float().sigmoid(), ids


class Llama4MoE(SparseMoE):
    """Each (token, chosen expert) pair runs the expert on the token times its weight; the
    pairs' outputs summed per token, plus the shared expert's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)  # (N, k)
        n, k = ids.shape
        rows = (x.unsqueeze(1) * weights.unsqueeze(-1)).reshape(n * k, -1)
        ones = torch.ones(n * k, 1, dtype=weights.dtype, device=weights.device)
        routed = self.experts(rows, ones, ids.reshape(n * k, 1)).view(n, k, -1).sum(1)
        return self.shared_expert(x) + routed


class Llama4ForCausalLM(LlamaForCausalLM):
    renames = (
        (r"^model\.", ""),
        (r"\.feed_forward\.router\.", ".mlp.gate."),
        (r"\.feed_forward\.", ".mlp."),
    )

    def __init__(self, cfg: ModelConfig):
        self.plan = _plan(cfg)
        super().__init__(cfg)

    def make_layer(self, index: int) -> nn.Module:
        cfg, rope, chunked = self.cfg, self.plan["rope"][index], self.plan["chunked"][index]
        chunk = cfg.get("attention_chunk_size") if chunked else None
        spec = AttentionSpec(scale=cfg.head_dim**-0.5, chunk=chunk)
        if rope:
            eps = cfg.get("rms_norm_eps", 1e-5) if cfg.get("use_qk_norm", True) else None
            positional = self._rope(eps)
        elif cfg.get("attn_temperature_tuning", True):
            scales = cfg.get("floor_scale", 8192), cfg.get("attn_scale", 0.1)
            positional = TemperatureTuning(*scales)
        else:
            positional = None
        bias = bool(cfg.get("attention_bias", False))
        attn = self.attention(index, spec=spec, rope=positional, qkv_bias=bias, o_bias=bias)
        norms = [self.make_norm(cfg.hidden_size) for _ in range(2)]
        return DecoderLayer(attn, self.make_mlp(index), *norms)

    def _rope(self, eps: float | None) -> NormedRope:
        """One rotation module for every rope layer (one table)."""
        if "_normed_rope" not in self.__dict__:
            spec = self.rope_spec(interleaved=True)
            self.__dict__["_normed_rope"] = NormedRope(spec, self.cfg.head_dim, eps)
        return self.__dict__["_normed_rope"]

    def make_norm(self, size: int | tuple[int, ...]) -> nn.Module:
        return RMSNorm(size, self.cfg.get("rms_norm_eps", 1e-5))  # NOTE: Llama 4's default

    def make_mlp(self, index: int) -> nn.Module:
        cfg = self.cfg
        hidden, act = cfg.hidden_size, cfg.get("hidden_act", "silu")
        size = cfg.get("intermediate_size")
        if index not in self.plan["moe"]:
            return GatedMLP(hidden, cfg.get("intermediate_size_mlp"), act)
        experts, top_k = cfg.get("num_local_experts"), cfg.get("num_experts_per_tok", 1)
        routed = FusedExperts(experts, hidden, size, act)
        return Llama4MoE(Llama4Router(hidden, experts, top_k), routed, GatedMLP(hidden, size, act))

    def transform(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The experts' (E, H, 2I) gate/up and (E, I, H) down -> (E, 2I, H) and (E, H, I)."""
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            return tensor.transpose(1, 2).contiguous()
        return tensor


def _plan(cfg: ModelConfig) -> dict:
    """Per layer: rotated or not, chunked or not; the MoE layers. Refuses (by name) the
    settings transformers would not run or that name no layer."""
    layers = cfg.num_layers

    def refuse(why: str):
        raise UnsupportedModelError(f"{cfg.architecture}: {why}")

    flags = cfg.get("no_rope_layers") or [
        int((i + 1) % cfg.get("no_rope_layer_interval", 4) != 0) for i in range(layers)
    ]
    if len(flags) < layers:
        refuse(f"no_rope_layers lists {len(flags)} layers, num_hidden_layers is {layers}")
    rope = [bool(f) for f in flags[:layers]]
    types = cfg.get("layer_types") or [CHUNKED if r else FULL for r in rope]
    if len(types) != layers or not set(types) <= {CHUNKED, FULL}:
        refuse(f"layer_types {types} (served: {CHUNKED}, {FULL}, one per layer)")
    chunk = cfg.get("attention_chunk_size")
    if CHUNKED in types and not (isinstance(chunk, int) and chunk > 0):
        refuse(f"attention_chunk_size {chunk!r} with {CHUNKED} layers (a positive int)")
    if not all(rope) and cfg.get("attn_temperature_tuning", True):
        if not cfg.get("floor_scale", 8192) > 0:
            refuse(f"floor_scale {cfg.get('floor_scale')!r} (temperature tuning divides by it)")
    moe = cfg.get("moe_layers")
    if moe is None:
        step = cfg.get("interleave_moe_layer_step", 1)
        moe = list(range(step - 1, layers, step))
    experts, top_k = cfg.get("num_local_experts", 16), cfg.get("num_experts_per_tok", 1)
    if moe and not 0 < top_k <= experts:
        refuse(f"num_experts_per_tok {top_k} of {experts} num_local_experts")
    return dict(rope=rope, chunked=[t == CHUNKED for t in types], moe=set(moe))
