"""The attention backend interface the model calls, and the per-step metadata it consumes.

Token order in a step: all decode rows (one query token each) first, then the prefill rows
(one contiguous run of query tokens per sequence). The runner builds one ``AttentionMetadata``
per step; every layer reuses it.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch


@dataclass
class PrefillSeq:
    query_start: int
    """Index of the sequence's first query token in the step's token batch."""
    query_len: int
    context_len: int
    """Tokens in the sequence after this step (cached + new)."""
    block_table: torch.Tensor
    """(num_blocks,) int64 block ids covering ``context_len``."""


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor
    """(num_tokens,) int64: flat cache slot (block * block_size + offset) of each new token."""
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None
    """(num_decodes, max_blocks) int64, padded with block 0."""
    decode_seq_lens: torch.Tensor | None
    """(num_decodes,) int64 context length including the new token."""
    prefills: list[PrefillSeq]
    block_size: int
    cache: dict = field(default_factory=dict)
    """Backend scratch shared by the layers of one step (e.g. masks per window size)."""
    state_slots: list[int] = field(default_factory=list)
    """Per sequence (decodes, then prefills): the state slot its state layers read and write
    (``StateSpec``); empty for a model without state layers."""
    decode_state_slots: torch.Tensor | None = None
    """(num_decode_tokens,) int64 on the device: ``state_slots`` of the decode rows."""
    state_saves: list[tuple[tuple[int, int], ...]] = field(default_factory=list)
    """Per prefill (empty: none): (tokens into its chunk, row) where the state ops copy the
    states into a checkpoint row midway (``core.state_prefix``)."""
    upload: Callable[[torch.Tensor], torch.Tensor] = field(default=lambda t: t, repr=False)
    """Host -> device copy for tensors a backend builds per step (set by ``to``)."""

    def to(self, move: Callable[[torch.Tensor], torch.Tensor]) -> AttentionMetadata:
        """A copy with every tensor passed through ``move`` (the host -> device upload)."""

        def opt(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else move(t)

        return replace(
            self,
            slot_mapping=move(self.slot_mapping),
            decode_block_tables=opt(self.decode_block_tables),
            decode_seq_lens=opt(self.decode_seq_lens),
            decode_state_slots=opt(self.decode_state_slots),
            prefills=[replace(p, block_table=move(p.block_table)) for p in self.prefills],
            cache={},
            upload=move,
        )


@dataclass(frozen=True)
class AttentionSpec:
    """What one layer's attention applies, declared by the model (``models.layers``)."""

    scale: float
    """Multiplies q.k (head_dim ** -0.5 unless the family overrides it)."""
    sliding_window: int | None = None
    """Attend to the last ``w`` positions only; None: full attention."""
    softcap: float | None = None
    """Scores become ``softcap * tanh(scores / softcap)`` before the softmax (Gemma 2)."""
    sinks: torch.Tensor | None = None
    """(Hq,) float32 logits that join each query's softmax denominator without a value
    (GPT-OSS's attention sinks); filled in from the model's weights after loading."""
    chunk: int | None = None
    """Attend only within the query's chunk of this many positions: a query at ``p`` sees
    keys ``p - p % chunk`` .. ``p`` (Llama 4's chunked local attention; with a window too,
    the later of the two first positions); None: no chunks."""
    kv_source: int | None = None
    """The earlier layer whose cached K/V this layer reads (Gemma 3n's and Gemma 4's last
    layers): it keeps and writes none of its own (``KVLayout.kv_sources``)."""

    @property
    def tuning_key(self) -> int | tuple[int | None, int] | None:
        """What selects a prefill kernel variant: the window, or (window, chunk) where the
        layer is chunked (``AttentionBackend.pretune``'s ``windows``)."""
        return self.sliding_window if self.chunk is None else (self.sliding_window, self.chunk)


@dataclass(frozen=True)
class StateSpec:
    """One fixed-size tensor a state layer keeps per request (a conv window, a recurrent
    matrix, an SSM state): it does not grow with the context."""

    name: str
    """What the layer's ops call it: ``conv`` (the last inputs of a causal conv1d) or
    ``recurrent`` (a linear-attention or SSM state)."""
    shape: tuple[int, ...]
    """Per request."""
    float32: bool = False
    """Kept in float32 whatever the model's dtype (the families' references keep recurrent
    states so); else in the model's dtype."""

    def nbytes(self, dtype_size: int) -> int:
        return math.prod(self.shape) * (4 if self.float32 else dtype_size)


ATTENTION = "attention"
"""The layer kind that reads and writes the paged KV cache."""


@dataclass(frozen=True)
class KVLayout:
    """What the paged cache holds per token and attention layer, and what each state layer
    keeps per request, declared by the model (``CausalLM.kv_layout``); the runner allocates
    ``(attention layers, entries, blocks, block_size, heads, dim)`` and, per state layer, each
    ``StateSpec`` once per state slot."""

    entries: int
    """2: separate K and V; 1: one tensor read as both K and V (MLA's latent cache, whose
    values are a prefix of its keys)."""
    heads: int
    dim: int
    kinds: tuple[str, ...] = ()
    """Per layer: ``ATTENTION`` or a state layer's kind (``gated_delta``, ``mamba2``,
    ``short_conv``); empty: every layer attends."""
    states: tuple[tuple[StateSpec, ...], ...] = ()
    """Per layer (as ``kinds``): the state tensors it keeps per request; empty for attention."""
    index_dim: int = 0
    """Width of the indexer key each attention layer keeps per token beside its K/V (sparse
    indexed attention, ``kernels.sparse_attention``), paged with them; 0: none."""
    kv_sources: tuple[int | None, ...] = ()
    """Per layer: the earlier layer whose K/V pages it reads instead of its own
    (``AttentionSpec.kv_source``); empty: every attention layer has its own."""

    def bytes_per_token(self, dtype_size: int) -> int:
        """Cache bytes one token takes in one attention layer."""
        return (self.entries * self.heads * self.dim + self.index_dim) * dtype_size

    def attends(self, layer: int) -> bool:
        return not self.kinds or self.kinds[layer] == ATTENTION

    def owns_kv(self, layer: int) -> bool:
        """An attention layer with pages of its own (not reading another's)."""
        shared = self.kv_sources and self.kv_sources[layer] is not None
        return self.attends(layer) and not shared

    def num_attention_layers(self, num_layers: int) -> int:
        """The attention layers that keep K/V pages (the memory they take)."""
        return sum(self.owns_kv(i) for i in range(num_layers))

    @property
    def has_state(self) -> bool:
        return any(self.states)

    def state_bytes(self, dtype_size: int) -> int:
        """State bytes one request keeps across all layers (whatever its context length)."""
        return sum(s.nbytes(dtype_size) for layer in self.states for s in layer)


class AttentionBackend(ABC):
    """Writes the step's new K/V into the paged cache and attends over it."""

    name: str

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # (N, Hq, D)
        k: torch.Tensor,  # (N, Hkv, D)
        v: torch.Tensor,  # (N, Hkv, D)
        k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
        v_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,  # (Hq,) float32
        chunk: int | None = None,  # AttentionSpec.chunk
    ) -> torch.Tensor:  # (N, Hq, D)
        ...

    def check_layout(self, layout: KVLayout, num_heads: int) -> None:
        """Refuse (``ValueError``) a KV layout the backend's kernels cannot serve; any here."""
        return None

    def pretune(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        num_heads: int,
        scale: float,
        windows: set[int | None],
        max_q: int,
        max_k: int,
    ) -> int:
        """Measure launch configs for every prefill shape bucket before serving (a snapshot
        then carries them); returns the number of shapes tuned. ``windows``: each layer's
        window (None: none), or (window, chunk) for a chunked layer. Nothing to tune here."""
        return 0


def write_kv(k, v, k_cache, v_cache, meta: AttentionMetadata) -> None:
    """Scatter the step's new K/V (N, Hkv, D) into the paged caches at ``meta.slot_mapping``
    (once when one cache serves as both: a 1-entry ``KVLayout``)."""
    hkv, d = k.shape[1], k.shape[2]
    k_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, k)
    if v_cache is not k_cache:
        v_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, v)
