"""The causal LM every family builds on: embedding -> decoder layers -> final norm -> LM head,
and the map from checkpoint tensor names to the model's own.

A family subclasses ``CausalLM``: ``make_layer`` builds one decoder layer (a module called as
``layer(x, positions, attend)``), ``make_norm`` the final norm, and the class attributes say
how its checkpoint names map (``renames``, ``stacked``, ``ignored``). The engine's eager
step, its compiled step and its CUDA graphs all run ``forward``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Callable

import torch
from torch import nn

from warmboot.architectures import TOWER_KEY, UnsupportedModelError
from warmboot.config import ModelConfig
from warmboot.kernels.backend import ATTENTION, AttentionSpec, KVLayout
from warmboot.kernels.step_ops import StepContext
from warmboot.models.layers.attention import Attention
from warmboot.models.layers.decoder import run_layers
from warmboot.models.layers.linear import Linear
from warmboot.models.layers.moe import FusedExperts
from warmboot.models.layers.norm import RMSNorm
from warmboot.models.layers.rope import RopeSpec, RotaryEmbedding
from warmboot.models.layers.state import StateMixer

TOWER_RENAMES = (
    (r"^model\.language_model\.", "model."),  # NOTE: transformers 5's names
    (r"^language_model\.model\.", "model."),  # NOTE: older saves' names
    (r"^language_model\.lm_head\.", "lm_head."),
)
"""A multimodal checkpoint's language-model tensors under the text model's names."""
TOWER_OTHERS = (
    r"^(model\.)?(visual|vision_tower|vision_model|multi_modal_projector|audio_tower"
    r"|embed_vision|embed_audio|patch_merge_mlp)\."
)
"""Its other towers' tensors (and their embedders into the text width): not read
(``architectures.TEXT_TOWERS``; Gemma 3n reads its embedders' token tables)."""
RunLayer = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
"""Runs one decoder layer: ``(layer, x, positions) -> x`` (the compiled step's graph)."""

STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
EXPERT_PROJECTIONS = {
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
_EXPERT = re.compile(
    r"(.+\.experts)\.(\d+)\.(\w+)\.(weight|weight_scale|weight_zero|weight_perm|input_scale)$"
)
_EXPERT_LEAF = {"weight": "", "weight_scale": "_scale", "weight_zero": "_zero"}
_EXPERT_LEAF |= {"weight_perm": "_perm", "input_scale": "_input_scale"}
"""A quantized expert's tensors (``models.quant_formats``' layout) -> our stacked names."""


def _with_sinks(attn: Attention) -> AttentionSpec:
    sinks = getattr(attn, "sinks", None)
    if sinks is None:
        return attn.spec
    return dataclasses.replace(attn.spec, sinks=sinks.detach().float().contiguous())


class CausalLM(nn.Module):
    renames: tuple[tuple[str, str], ...] = ((r"^model\.", ""),)
    """(regex, replacement) applied in order to every checkpoint name."""
    stacked: dict[str, tuple[str, int]] = STACKED
    """Checkpoint module name -> (our stacked module, shard index)."""
    expert_projections: dict[str, tuple[str, int]] = EXPERT_PROJECTIONS
    """Per-expert checkpoint projection (``...experts.<e>.<proj>.weight``) -> (the stacked
    ``FusedExperts`` parameter, its place within the expert: gate 0, up 1)."""
    ignored: tuple[str, ...] = (r"rotary_emb\.inv_freq$",)
    """Checkpoint tensors known to be harmless and not read (stored rope buffers)."""
    tied_by_default = False
    """Whether the head is tied when ``config.json`` does not say (transformers' default for
    the family: Cohere, Ernie 4.5, StarCoder2)."""
    rope_class: type[RotaryEmbedding] = RotaryEmbedding
    """What ``shared_rope`` builds (a family whose rotation casts differently subclasses it)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if self.tied_by_default and cfg.hf.get("tie_word_embeddings") is None:
            cfg = dataclasses.replace(cfg, tie_word_embeddings=True)
        self.cfg = cfg
        # NOTE: an explicit (uninitialised) weight skips Embedding's normal_ init, which on the
        # meta device imports torch._dynamo: 1-1.6 s of every cold boot.
        weight = torch.empty(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(self.make_layer(i) for i in range(cfg.num_layers))
        self.norm = self.make_norm(cfg.hidden_size)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=self.head_bias())
        if cfg.tie_word_embeddings:
            del self.lm_head.weight  # NOTE: set to the embedding's by ``tie_weights``
        self.embed_scale: float | None = None
        """Multiplies the embeddings (Granite's ``embedding_multiplier``)."""
        self.logit_scale: float | None = None
        """Multiplies the logits (Cohere's ``logit_scale``)."""
        self.final_softcap: float | None = None
        """Logits become ``c * tanh(logits / c)`` (Gemma 2's ``final_logit_softcapping``)."""

    # -- what a family provides ----------------------------------------------------------------
    def make_layer(self, index: int) -> nn.Module:
        raise NotImplementedError

    def make_norm(self, size: int | tuple[int, ...]) -> nn.Module:
        return RMSNorm(size, self.cfg.get("rms_norm_eps", 1e-6))

    def head_bias(self) -> bool:
        return False

    def rope_spec(self, **overrides) -> RopeSpec:
        """The config's rope (``rope_parameters`` or ``rope_scaling`` + ``rope_theta``)."""
        cfg = self.cfg
        params = cfg.get("rope_parameters") or cfg.get("rope_scaling")
        kwargs = dict(
            theta=cfg.get("rope_theta", 10000.0),
            max_position_embeddings=cfg.max_position_embeddings,
            partial_rotary_factor=cfg.get("partial_rotary_factor", 1.0),
        )
        return RopeSpec.parse(params, **(kwargs | overrides))

    def attention(self, index: int, **kwargs) -> Attention:
        """A self-attention block of the config's shape; ``kwargs`` override or add."""
        cfg = self.cfg
        window = self.sliding_window(index)
        spec = AttentionSpec(scale=cfg.head_dim**-0.5, sliding_window=window)
        base = dict(spec=spec, rope=self.shared_rope(self.rope_spec()))
        return Attention(
            cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, **(base | kwargs)
        )

    def sliding_window(self, index: int) -> int | None:
        """Layer ``index``'s window: ``layer_types`` when given, else the config's window."""
        cfg = self.cfg
        types = cfg.get("layer_types")
        if types is not None:
            return cfg.get("sliding_window") if types[index] == "sliding_attention" else None
        return cfg.get("sliding_window")

    def shared_rope(self, spec: RopeSpec) -> RotaryEmbedding:
        """One rotary embedding (one table) per distinct spec, shared by the layers."""
        ropes = self.__dict__.setdefault("_ropes", {})
        if spec not in ropes:
            ropes[spec] = self.rope_class(spec, self.cfg.head_dim)
        return ropes[spec]

    # -- the step --------------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x if self.embed_scale is None else x * self.embed_scale

    def forward(
        self,
        input_ids: torch.Tensor,  # (N,)
        positions: torch.Tensor,  # (N,)
        step: StepContext | None,
        run_layer: RunLayer | None = None,
    ) -> torch.Tensor:  # (N, hidden), final-normed
        x = self.embed(input_ids)
        return self.norm(run_layers(self.layers, x, positions, step, run_layer))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(M, hidden) -> (M, vocab) float32."""
        logits = self.lm_head(hidden).float()
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    # -- facts for the runner --------------------------------------------------------------------
    def attention_layers(self) -> list[nn.Module | None]:
        """Each layer's attention module: the first that carries an ``AttentionSpec``
        (``Attention``, ``MLAttention``); None for a state layer (``StateMixer``)."""
        return [next((m for m in la.modules() if _has_spec(m)), None) for la in self.layers]

    def state_mixers(self) -> list[StateMixer | None]:
        """Each layer's state mixer (a hybrid's linear-attention, SSM or conv layer), or None."""
        found = ([m for m in la.modules() if isinstance(m, StateMixer)] for la in self.layers)
        return [m[0] if m else None for m in found]

    def kv_layout(self) -> KVLayout:
        """What the paged KV cache holds per token and attention layer: K and V of the
        config's heads (MLA overrides it with one latent entry); and each state layer's kind
        and per-request tensors."""
        return self.with_states(KVLayout(2, self.cfg.num_kv_heads, self.cfg.head_dim))

    def with_states(self, layout: KVLayout) -> KVLayout:
        """``layout`` with the state layers and the layers reading another's K/V declared (as
        is for a model without any)."""
        layout = self.with_kv_sources(layout)
        mixers = self.state_mixers()
        if not any(mixers):
            return layout
        for i, (mixer, attn) in enumerate(zip(mixers, self.attention_layers(), strict=True)):
            if (mixer is None) == (attn is None):
                what = "both attention and a state mixer" if attn else "no token mixer"
                raise UnsupportedModelError(f"layer {i} has {what}")
        kinds = tuple(ATTENTION if m is None else m.kind for m in mixers)
        states = tuple(() if m is None else m.state_specs() for m in mixers)
        return dataclasses.replace(layout, kinds=kinds, states=states)

    def with_kv_sources(self, layout: KVLayout) -> KVLayout:
        """``layout`` with the layers that read an earlier layer's K/V (``AttentionSpec``)."""
        specs = [a if a is None else a.spec for a in self.attention_layers()]
        sources = tuple(None if s is None else s.kv_source for s in specs)
        for i, src in enumerate(sources):
            owner = src is not None and 0 <= src < i and specs[src] is not None
            if src is not None and not (owner and specs[src].kv_source is None):
                raise UnsupportedModelError(f"layer {i} reads the K/V of layer {src}")
        if all(s is None for s in sources):
            return layout
        return dataclasses.replace(layout, kv_sources=sources)

    def attention_specs(self) -> list[AttentionSpec | None]:
        """Per layer, with the module's current sinks (float32) once the weights are in;
        None for a state layer."""
        return [a if a is None else _with_sinks(a) for a in self.attention_layers()]

    def graph_safe(self) -> bool:
        """Whether a step may be captured as a CUDA graph: none syncs with the host (the
        grouped expert step reads its per-expert token counts on the host; state layers
        index their slots per sequence from host lists)."""
        host = (FusedExperts, StateMixer)
        return not any(isinstance(m, host) for m in self.modules())

    def rotary_embeddings(self) -> list[RotaryEmbedding]:
        """Every rotary embedding the layers use, once each (the loader builds their tables)."""
        found = {id(m): m for m in self.modules() if isinstance(m, RotaryEmbedding)}
        return list(found.values())

    def prefix_root(self, prompt_len: int) -> bytes | None:
        """The prefix-cache root of a request with a ``prompt_len`` prompt: None where its KV
        depends on its tokens alone, else a digest of what else (a length-dependent rope)."""
        found = {v for r in self.rotary_embeddings() if (v := r.spec.prefix_variant(prompt_len))}
        return hashlib.blake2b(" ".join(sorted(found)).encode()).digest() if found else None

    # -- checkpoint names ------------------------------------------------------------------------
    def map_name(self, name: str) -> tuple[str, int | None] | None:
        """Checkpoint name -> (our parameter, shard index or None); None: ignored by design."""
        if self.cfg.get(TOWER_KEY):  # NOTE: a multimodal checkpoint's language model
            if re.search(TOWER_OTHERS, name):
                return None
            name = next((re.sub(p, r, name) for p, r in TOWER_RENAMES if re.search(p, name)), name)
        if any(re.search(p, name) for p in self.ignored):
            return None
        for pattern, repl in self.renames:
            name = re.sub(pattern, repl, name)
        expert = _EXPERT.match(name)
        if expert and expert[3] in self.expert_projections:
            target, sub = self.expert_projections[expert[3]]
            per_expert = 2 if target == "gate_up_proj" else 1
            leaf = _EXPERT_LEAF[expert[4]]
            return f"{expert[1]}.{target}{leaf}", int(expert[2]) * per_expert + sub
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in self.stacked:
            target, shard = self.stacked[parts[-2]]
            return ".".join([*parts[:-2], target, parts[-1]]), shard
        return name, None

    def transform(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor (already under our ``name``) into our layout; default as is."""
        return tensor

    def tie_weights(self) -> None:
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight


def checked_kinds(types: list[str], num_layers: int, kinds, family: str = "") -> list[str]:
    """A hybrid's per-layer kinds (``layer_types``), refused by name where their count is not
    the layer count or a kind is not one of ``kinds``."""
    if len(types) != num_layers:
        raise UnsupportedModelError(
            f"layer_types lists {len(types)} layers, num_hidden_layers is {num_layers}"
        )
    unknown = sorted(set(types) - set(kinds))
    if unknown:
        raise UnsupportedModelError(
            f"{family}layer kind(s) {unknown} are not served; served: {', '.join(sorted(kinds))}"
        )
    return list(types)


def _has_spec(module: nn.Module) -> bool:
    return isinstance(getattr(module, "spec", None), AttentionSpec)
