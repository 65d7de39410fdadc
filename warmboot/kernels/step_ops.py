"""The ops a compiled model step keeps out of its graph, and the per-step state they read.

A compiled step (``device.compiled``) traces the decoder with ``torch.compile``. The paged KV
cache, the step's metadata (a Python list of prefills, block tables of any width), the
attention backend and the prepacked weights are not graph inputs: the runner binds them for
the step (``bound``) and the ops look them up. The graph sees tensors of the step's token
count and constant ints only, so no batch make-up recompiles, one graph serves every layer,
and two engines of one model trace the same graph (inductor's caches hit).

- ``warmboot::paged_attention(q, k, v, layer)``: write layer ``layer``'s new K/V and attend.
- ``warmboot::fused_experts(x, weights, ids, layer, slot)``: the layer's experts number
  ``slot`` (``ExpertTable``) over the routed tokens: one GEMM pair per active expert, on
  packed weights where the CPU packs them (a ``FusedExperts`` reaches it through its
  ``OpExperts`` method).
- ``warmboot::packed_gated(x, layer, slot, out_features)``: a gated MLP's ``silu(gate) * up``
  of the stacked gate/up linear ``slot``, the activation in native code shared with the
  helper thread, and fused into a prefill's row-blocked GEMM (``csrc/gated.cpp``). A
  ``GatedMLP`` of a packed view reaches it where ``native_silu`` holds (``fused_silu``).
- ``warmboot::packed_linear(x, layer, slot, out_features)``: ``x @ W.T + b`` with W the
  layer's linear number ``slot`` prepacked (``PackedLinears``): bf16 in the native GEMM's
  panels (``kernels.native``: 1.75-1.8x oneDNN at 1-8 rows), else in oneDNN's blocked layout
  (1.2-2x ``F.linear`` at decode sizes). A ``Linear`` reaches it through its
  ``PackedMethod`` (``models.layers.linear``).

``layer`` is a 0-d int64 tensor, the layer's ``STEP_INDEX`` buffer (``device.compiled``): a
graph input, not a constant, so one traced layer serves them all. An eager step calls the
same ``StepContext`` directly as its attention, after the model sets ``StepContext.layer``.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from warmboot.kernels import native
from warmboot.kernels.backend import AttentionBackend, AttentionMetadata, AttentionSpec
from warmboot.kernels.experts import grouped_experts


class PackedLinears:
    """Weights packed once for the GEMM (``pack_weight``; copies, the model keeps its own):
    per layer one row per projection slot, and the LM head."""

    def __init__(self) -> None:
        self.kernel = "native"
        """The bf16 GEMM: ``native`` (``kernels.native``, where it builds) or ``onednn``;
        ``use`` switches (``device.step_choice`` measures which is faster)."""
        self.dense_rows: int | None = None
        """From this many rows on, a natively packed weight's GEMM is torch's on the model's
        own weight (oneDNN's: its blocking wins at prefill sizes, and from a few rows on a CPU
        where the native kernel is compute-bound), in row blocks a helper thread may share
        (``csrc/dense.cpp``); None: never. Measured by ``device.step_choice.dense_rows``."""
        self.experts: list[list[ExpertTable]] = []
        """Per layer: its ``FusedExperts``, in slot order (``fused_experts``)."""
        self.layers: list[list[tuple[torch.Tensor, torch.Tensor | None]]] = []
        self.head: torch.Tensor | None = None
        self.head_bias: torch.Tensor | None = None
        self._sources: list[list[torch.Tensor]] = []
        self._head_source: torch.Tensor | None = None
        self._packs: dict[int, torch.Tensor] = {}
        """id of a source weight -> its packing: a weight several layers share (HRM-Text's
        weight-tied calls) is packed once."""

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        return pack_weight(weight, self.kernel)

    def use(self, kernel: str) -> None:
        """Pack every weight again for ``kernel`` (no recompile: the GEMM op is opaque)."""
        if kernel != self.kernel:
            self.release()
            self.kernel = kernel
            self.repack()

    def set_dense_rows(self, rows: int | None) -> None:
        self.dense_rows = rows
        for table in (t for row in self.experts for t in row):
            table.dense_rows = rows

    def add_layer(self, linears: list[nn.Module]) -> None:
        """One decoder layer's linears (anything with ``weight`` and ``bias``), in slot order."""
        self._sources.append([lin.weight for lin in linears])
        self.layers.append([(self._pack_once(lin.weight), _detached(lin.bias)) for lin in linears])

    def _pack_once(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` packed, or the packing another layer sharing it has already."""
        packed = self._packs.get(id(weight))
        if packed is None:
            packed = self._packs[id(weight)] = self.pack(weight)
        return packed

    def set_head(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self._head_source, self.head = weight, self.pack(weight)
        self.head_bias = _detached(bias)

    def release(self) -> int:
        """Drop the packed copies (before a process checkpoint: the image then holds none);
        returns the bytes freed. ``repack`` makes them again from the model's weights."""
        sources = {id(w): w for w in self._sources_flat()}.values()
        freed = sum(w.numel() * w.element_size() for w in sources)
        freed += sum(table.release() for row in self.experts for table in row)
        self.layers = [[(None, b) for _, b in row] for row in self.layers]
        self._packs.clear()
        self.head = None
        return freed

    def stash(self, keep: Callable[[torch.Tensor], torch.Tensor | None]) -> None:
        """Hand each packed weight to ``keep`` before a process checkpoint, which returns it
        kept elsewhere (``snapshot.stash.keeper``: in the store's chunk files, mapped from
        there) or None; what it does not keep (oneDNN's opaque layout) and the experts' tables
        are released for ``repack``."""
        for table in (t for row in self.experts for t in row):
            table.release()
        kept: dict[int, torch.Tensor | None] = {}  # NOTE: a shared packing kept once
        for w in (w for row in self.layers for w, _ in row if w is not None):
            if id(w) not in kept:
                kept[id(w)] = keep(w)
        self.layers = [
            [(w if w is None else kept[id(w)], b) for w, b in row] for row in self.layers
        ]
        self._packs.clear()
        self.head = None if self.head is None else keep(self.head)

    def repack(self) -> None:
        """Pack what is released (all of it after ``release``; after ``stash``, what it could
        not keep)."""
        for table in (t for row in self.experts for t in row):
            table.repack(self.kernel)
        self.layers = [
            [
                (self._pack_once(s) if w is None else w, b)
                for s, (w, b) in zip(src, row, strict=True)
            ]
            for src, row in zip(self._sources, self.layers, strict=True)
        ]
        if self.head is None and self._head_source is not None:
            self.head = self.pack(self._head_source)

    def _sources_flat(self) -> list[torch.Tensor]:
        head = [] if self._head_source is None else [self._head_source]
        return [w for row in self._sources for w in row] + head

    def lookup(self, layer: int, slot: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        weight, bias = (
            (self.head, self.head_bias) if slot == HEAD_SLOT else self.layers[layer][slot]
        )
        if weight is None:
            raise RuntimeError("the packed weights are released (repack() after a restore)")
        return weight, bias

    def source(self, layer: int, slot: int) -> torch.Tensor:
        """The model's own weight behind ``lookup``'s packed one."""
        return self._head_source if slot == HEAD_SLOT else self._sources[layer][slot]


HEAD_SLOT = -1


class ExpertTable:
    """One ``FusedExperts``' weights for the compiled step: each expert's two matrices packed
    (``pack_weight``: copies, when ``pack``), or the module's own dense weights."""

    def __init__(self, module: nn.Module, pack: bool, kernel: str = "native"):
        self.module, self.kernel = module, kernel
        self.pack = pack and module.method.packable
        self.method = module.method  # NOTE: before the view swaps in OpExperts
        self.dense_rows: int | None = None  # NOTE: PackedLinears.dense_rows
        self.gate_up: list[torch.Tensor] | None = None
        self.down: list[torch.Tensor] | None = None
        self.repack()

    def repack(self, kernel: str | None = None) -> None:
        """Pack again (after ``release``), for ``kernel`` if given."""
        self.kernel = kernel or self.kernel
        if self.pack and self.gate_up is None:
            self.gate_up = [pack_weight(w, self.kernel) for w in self.module.gate_up_proj]
            self.down = [pack_weight(w, self.kernel) for w in self.module.down_proj]

    def release(self) -> int:
        if not self.pack or self.gate_up is None:
            return 0
        m = self.module
        self.gate_up = self.down = None
        return sum(w.numel() * w.element_size() for w in (m.gate_up_proj, m.down_proj))

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        m = self.module
        if not self.pack:
            return self.method.apply(m, x, weights, ids)
        if self.gate_up is None:
            raise RuntimeError("the packed experts are released (repack() after a restore)")
        gate_up, down, b13, b2 = self.gate_up, self.down, m.gate_up_proj_bias, m.down_proj_bias

        n13, n2 = m.gate_up_proj.shape[1], m.down_proj.shape[1]

        def up_gemm(e: int, rows: torch.Tensor) -> torch.Tensor:
            bias = None if b13 is None else b13[e]
            if dense(rows, gate_up[e], self.dense_rows):
                return F.linear(rows, m.gate_up_proj[e], bias)
            return packed_gemm(rows, gate_up[e], bias, n13)

        def down_gemm(e: int, rows: torch.Tensor) -> torch.Tensor:
            bias = None if b2 is None else b2[e]
            if dense(rows, down[e], self.dense_rows):
                return F.linear(rows, m.down_proj[e], bias)
            return packed_gemm(rows, down[e], bias, n2)

        return grouped_experts(x, weights, ids, m.num_experts, up_gemm, down_gemm, m.act_and_mul)


def packed_gemm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n: int
) -> torch.Tensor:
    if weight.dim() == 4:  # NOTE: native panels (pack_weight)
        return torch.ops.warmboot_cpu.linear(x, weight, bias, n)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def dense(x: torch.Tensor, weight: torch.Tensor, dense_rows: int | None) -> bool:
    """Whether ``x`` has the rows from which ``weight``'s natively packed GEMM gives way to
    ``F.linear`` on the model's own weight (``PackedLinears.dense_rows``)."""
    return dense_rows is not None and weight.dim() == 4 and x.numel() >= dense_rows * x.shape[-1]


def pack_weight(weight: torch.Tensor, kernel: str = "native") -> torch.Tensor:
    """Native panels (4-D) where ``kernel`` is native and it takes ``weight``, else oneDNN's
    blocked layout (``packed_gemm`` tells them apart)."""
    if kernel == "native" and native_gemm(weight):
        return torch.ops.warmboot_cpu.pack_linear(weight.detach())
    if weight.dtype == torch.bfloat16 and not onednn_bf16():
        raise RuntimeError(f"oneDNN cannot pack a bf16 {tuple(weight.shape)} weight on this CPU")
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def native_gemm(weight: torch.Tensor) -> bool:
    """Whether ``pack_weight`` gives ``weight`` to the native bf16 GEMM."""
    return (
        weight.dtype == torch.bfloat16
        and weight.shape[-1] % 2 == 0
        and weight.device.type == "cpu"
        and native.library() is not None
    )


def _detached(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and (dtype == torch.float32 or onednn_bf16() or native.library() is not None)
    )


@functools.cache
def onednn_bf16() -> bool:
    """Whether oneDNN packs bf16 weights on this CPU: it needs AVX-512 (BW, VL, DQ) or
    AVX-NE-CONVERT, which an AVX2-only CPU lacks."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), None)
    except RuntimeError:
        return False
    return True


@dataclass
class StepContext:
    """One step's state: what attention needs per layer, and the packed weights."""

    backend: AttentionBackend
    kv_caches: list[tuple[torch.Tensor, ...]]
    """Per layer: K and V pages, then indexer key pages where kept (``Pools.kv``)."""
    meta: AttentionMetadata | None
    specs: list[AttentionSpec]
    """Per layer: scale, window, soft-cap (``CausalLM.attention_specs``)."""
    linears: PackedLinears | None = None
    layer: int = 0
    """The layer now running: attention and the ops read its caches and weights."""
    states: list[dict[str, torch.Tensor] | None] = field(default_factory=list)
    """Per layer: a state layer's per-request tensors by ``StateSpec`` name, one row per
    state slot (``kernels.state_ops``); None for attention layers."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The running layer's attention (an eager step's ``Attend``)."""
        return self.attend(self.layer, q, k, v)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Layer ``layer``'s attention: write its new K/V and attend."""
        if self.meta is None:
            raise RuntimeError("attention ran in a step without attention metadata")
        k_cache, v_cache = self.kv_caches[layer][:2]
        s = self.specs[layer]
        if s.kv_source is not None:  # NOTE: the source layer wrote them this step: rewritten as is
            k, v = cached_kv(k_cache, v_cache, self.meta.slot_mapping)
        facts = (s.scale, s.sliding_window, s.softcap, s.sinks)
        return self.backend.forward(q, k, v, k_cache, v_cache, self.meta, *facts, chunk=s.chunk)


def cached_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor):
    """The K/V (N, Hkv, D) held at the step's slots: what a layer reading another's pages
    attends with for its new tokens."""
    hkv, d = k_cache.shape[-2:]
    return k_cache.view(-1, hkv, d)[slots], v_cache.view(-1, hkv, d)[slots]


_LOCAL = threading.local()


@contextmanager
def bound(ctx: StepContext) -> Iterator[None]:
    """Bind a step's state for the ops run on this thread (each engine has its own)."""
    previous = getattr(_LOCAL, "ctx", None)
    _LOCAL.ctx = ctx
    try:
        yield
    finally:
        _LOCAL.ctx = previous


def _context(op: str) -> StepContext:
    ctx = getattr(_LOCAL, "ctx", None)
    if ctx is None:
        raise RuntimeError(f"warmboot::{op} ran outside a bound step")
    return ctx


# NOTE: the two per-layer ops are defined on a Library, not with torch.library.custom_op,
# whose Python wrapper cost ~12 us more a call (151 calls a decode step of the demo model).
# Declared functional: paged_attention's one side effect, the KV write, is on state the graph
# never sees, and each layer graph calls it once with an output that is always used.
_LIB = torch.library.Library("warmboot", "FRAGMENT")
_LIB.define("paged_attention(Tensor q, Tensor k, Tensor v, Tensor layer) -> Tensor")
_LIB.define("packed_linear(Tensor x, Tensor layer, int slot, int out_features) -> Tensor")
_LIB.define("packed_gated(Tensor x, Tensor layer, int slot, int out_features) -> Tensor")

STEP_INDEX = "step_index"
"""The buffer (0-d int64, the layer's number) that a packed view's layers and their linears
and experts carry, and hand to the ops."""


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: torch.Tensor):
    return _context("paged_attention").attend(int(layer), q, k, v)


def packed_linear(x: torch.Tensor, layer: torch.Tensor, slot: int, out_features: int):
    table, i = _context("packed_linear").linears, int(layer)
    weight, bias = table.lookup(i, slot)
    if dense(x, weight, table.dense_rows):  # NOTE: a natively packed weight: the library is loaded
        return torch.ops.warmboot_cpu.dense_linear(x, table.source(i, slot), bias)
    return packed_gemm(x, weight, bias, out_features)


def packed_gated(x: torch.Tensor, layer: torch.Tensor, slot: int, out_features: int):
    table, i = _context("packed_gated").linears, int(layer)
    weight, bias = table.lookup(i, slot)
    if dense(x, weight, table.dense_rows):
        return torch.ops.warmboot_cpu.dense_gated(x, table.source(i, slot), bias)
    return torch.ops.warmboot_cpu.silu_mul(packed_gemm(x, weight, bias, out_features))


def native_silu(dtype: torch.dtype) -> bool:
    """Whether a packed view's gated MLPs of ``dtype`` with SiLU run ``packed_gated``: bf16
    where the native kernels run AVX-512 BF16 (elsewhere its exp is the C library's, slower
    than inductor's vectorised kernel). Its bits are inductor's fused kernel's (float32
    arithmetic, one rounding) but for exp's last bit."""
    return (
        dtype == torch.bfloat16 and native.library() is not None and native.isa() == "avx512_bf16"
    )


_LIB.impl("paged_attention", paged_attention, "CompositeExplicitAutograd")
_LIB.impl("packed_linear", packed_linear, "CompositeExplicitAutograd")
_LIB.impl("packed_gated", packed_gated, "CompositeExplicitAutograd")


@torch.library.register_fake("warmboot::paged_attention")
def _(q, k, v, layer):
    return torch.empty_like(q)


@torch.library.register_fake("warmboot::packed_linear")
def _(x, layer, slot, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


@torch.library.register_fake("warmboot::packed_gated")
def _(x, layer, slot, out_features):
    return x.new_empty((*x.shape[:-1], out_features // 2))


@torch.library.custom_op("warmboot::fused_experts", mutates_args=())
def fused_experts(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, layer: torch.Tensor, slot: int
) -> torch.Tensor:
    return _context("fused_experts").linears.experts[int(layer)][slot](x, weights, ids)


@fused_experts.register_fake
def _(x, weights, ids, layer, slot):
    return torch.empty_like(x)
