"""Compiled model steps: the decoder traced once by ``torch.compile`` (inductor) for every
step the engine runs (decode, prefill, mixed), the token count symbolic.

What it buys on the CPU (``docs/benchmarks/decode.md``): RMSNorm, rope, SiLU-and-mul and the
residual adds fused into a few C++ loops, and every GEMM on weights prepacked once for
oneDNN (``kernels.step_ops.PackedLinears``): 1.2-1.6x the eager steps. Attention and the
GEMMs are opaque ops that find the paged cache, the step's metadata and the packed weights
in the bound step context: the graph sees the token count and ints only, so no batch make-up
recompiles, and the graph is the same in every process of one model, which lets inductor's
caches, and the snapshot that carries them (``snapshot.compile_artifacts``), skip the
compile.

One region a step: the model's forward (embedding, every decoder layer, final norm) is one
graph, in which each layer is a nested compile region (``torch.compiler.nested_compile_region``):
traced and compiled once for all layers of one structure, then called per layer from
inductor's wrapper (its ``repeated_subgraph``). The ops get the layer's number as a tensor
(its ``STEP_INDEX`` buffer), so the layers differ in inputs only. A step enters dynamo twice
(hidden rows, then the LM head's logits) instead of once a layer (30 a demo-model step; with
guards skipped, ``guard_gate``, the saving was within a 2-vCPU Xeon's noise), and a warm
compile (inductor's caches hit) stays a second or two, as one traced layer's. ``warm_up``
compiles both at start-up on scratch rows, so no request waits for a compile (a restore does
it in the background while eager steps serve: ``engine.background_compile``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import itertools
import logging
import threading
import time
import types
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from warmboot.device import guard_gate
from warmboot.device.threads import torch_threads
from warmboot.kernels.backend import AttentionBackend, AttentionMetadata
from warmboot.kernels.step_ops import (
    HEAD_SLOT,
    STEP_INDEX,
    ExpertTable,
    PackedLinears,
    StepContext,
    bound,
    can_pack,
    native_silu,
)
from warmboot.models.base import CausalLM
from warmboot.models.layers.activation import GatedMLP
from warmboot.models.layers.linear import Linear, PackedMethod
from warmboot.models.layers.moe import FusedExperts, OpExperts
from warmboot.models.layers.state import StateMixer

log = logging.getLogger(__name__)


@dataclass
class CompileStats:
    graphs: int = 0
    """Graphs handed to inductor (one dynamo trace each)."""
    seconds: float = 0.0
    """Time inside inductor: lowering, codegen and C++ builds, or cache loads when warm."""
    cache_hits: int = 0
    cache_misses: int = 0
    """Inductor FX-graph cache lookups: a miss is a real compile."""


class CompiledSteps:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, ...]],
        backend: AttentionBackend,
        dtype: torch.dtype,
        cpu_threads: int | None = None,
        kernel: str = "native",
    ):
        self.kv_caches = kv_caches
        self.state_caches: list[dict[str, torch.Tensor] | None] = []
        """Per layer: a state layer's tensors (``ModelRunner.state_caches``)."""
        self.backend = backend
        self.linears = PackedLinears()
        self.linears.kernel = kernel
        self.device = next(model.parameters()).device
        self.packed = can_pack(dtype, self.device)
        self.model = packed_view(model, self.linears, self.packed)
        self.specs = model.attention_specs()
        self.stats = CompileStats()
        self.cpu_threads = cpu_threads
        """OpenMP threads of the generated C++ kernels (baked in at compile time): the
        device thread's count, whichever thread compiles."""
        self.guard_free = False
        """Warmed, with one graph for the step's hidden rows and one for its logits, neither
        specialised on the row count: steps skip dynamo's guards (``guard_gate``)."""
        self._hidden = self._compile(_own_code(_model_step))
        self._head = self._compile(_own_code(_head_step))

    def _compile(self, fn: Callable) -> Callable:
        # NOTE: the backend holds the stats, never self: dynamo keeps backends alive with its
        # code cache, and a CompiledSteps kept alive keeps its weights (in a process image too).
        # Static but the rows (unbacked: ``_symbolic_rows``). Not dynamic=True: the weights'
        # shapes would turn symbolic, which nested regions refuse (torch 2.13); not the default
        # either: its automatic dynamic, keyed by file and line (every engine's copy of the
        # code alike), turns a float that differs between two models' layers (an eps) into a
        # region operand, which nested regions refuse too
        backend = functools.partial(_inductor, self.stats)
        return torch.compile(fn, backend=backend, dynamic=False, fullgraph=True)

    def context(self, meta: AttentionMetadata | None) -> StepContext:
        return StepContext(
            self.backend, self.kv_caches, meta, self.specs, self.linears, states=self.state_caches
        )

    def hidden(
        self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """(N,) ids and positions of a step -> (N, hidden), final-normed: the model's own
        ``forward``, compiled as one region."""
        _allow_entries()
        _symbolic_rows(ids, positions)
        with bound(self.context(meta)):
            return self._unguarded(lambda: self._hidden(self.model, ids, positions))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(M, hidden) -> (M, vocab) float32."""
        _allow_entries()
        _symbolic_rows(hidden)
        with bound(self.context(None)):
            return self._unguarded(lambda: self._head(self.model, hidden))

    def _unguarded(self, call: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``call`` without guards where ``guard_free``, else guarded (``guard_gate``: no
        step of another engine skips them meanwhile). Should a guard-free call still need a
        trace (torch raises then, before running anything), it runs again guarded: the
        layers it ran already wrote the same K/V as the rerun writes."""
        if self.guard_free:
            try:
                with guard_gate.unguarded():
                    return call()
            except RuntimeError as e:
                if not guard_gate.needed_a_trace(e):
                    raise
            log.warning("a warmed compiled step needed a new trace; compiling it now")
        with guard_gate.guarded():
            return call()

    def warm_up(
        self, scratch_block: int, block_size: int, scratch_state_slot: int = 0
    ) -> CompileStats:
        """Compile both graphs on two scratch decode rows (they write only the scratch block,
        which no request owns): every later step, of any token count, reuses them. Then one
        and three rows: if either traced again, a graph depends on the row count and the
        steps keep their guards (logged)."""
        import torch._inductor.config as inductor_config

        threads = {"cpp.threads": self.cpu_threads} if self.cpu_threads else {}
        # NOTE: traced with the device thread's torch thread count, or its first step recompiles
        with (
            guard_gate.guarded(),
            torch.inference_mode(),
            inductor_config.patch(threads),
            torch_threads(self.cpu_threads),
        ):
            traced = [
                self._scratch_step(rows, scratch_block, block_size, scratch_state_slot)
                for rows in (2, 1, 3)
            ]
        # NOTE: one graph per code object, and each engine's code is its own (``_own_code``):
        # nothing is left for the guards to tell apart
        self.guard_free = traced[0] == traced[-1] == 2
        if traced[0] != traced[-1]:
            log.warning("a compiled graph depends on the row count: steps keep their guards")
        return self.stats

    def _scratch_step(self, rows: int, scratch_block: int, block_size: int, state: int) -> int:
        """One scratch decode step of ``rows`` rows; the graphs traced so far."""
        device = self.device
        # NOTE: inputs made outside inference mode, as the runner's are (else every step
        # fails a dispatch-key guard and recompiles)
        with torch.inference_mode(False):
            meta = scratch_decode(rows, 1, scratch_block, block_size, device, state)
            ids = torch.zeros(rows, dtype=torch.int64, device=device)
            positions = torch.zeros_like(ids)
        self.logits(self.hidden(ids, positions, meta))
        return self.stats.graphs


def scratch_decode(
    rows: int,
    context: int,
    scratch_block: int,
    block_size: int,
    device: torch.device,
    scratch_state_slot: int = 0,
) -> AttentionMetadata:
    """``rows`` decode rows of ``context`` tokens (<= block_size) that read and write only the
    scratch block and state slot, which no request owns: a step to compile or time between
    real ones."""
    i64 = dict(dtype=torch.int64, device=device)
    return AttentionMetadata(
        slot_mapping=torch.full((rows,), scratch_block * block_size + context - 1, **i64),
        num_decode_tokens=rows,
        decode_block_tables=torch.full((rows, 1), scratch_block, **i64),
        decode_seq_lens=torch.full((rows,), context, **i64),
        prefills=[],
        block_size=block_size,
        state_slots=[scratch_state_slot] * rows,
        decode_state_slots=torch.full((rows,), scratch_state_slot, **i64),
    )


def _inductor(stats: CompileStats, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
    from torch._dynamo.utils import counters
    from torch._inductor.compile_fx import compile_fx

    inductor = counters["inductor"]
    hits, misses = inductor["fxgraph_cache_hit"], inductor["fxgraph_cache_miss"]
    t0 = time.perf_counter()
    compiled = compile_fx(gm, example_inputs)
    stats.seconds += time.perf_counter() - t0
    stats.graphs += 1
    stats.cache_hits += inductor["fxgraph_cache_hit"] - hits
    stats.cache_misses += inductor["fxgraph_cache_miss"] - misses
    return compiled


def _own_code(fn: Callable) -> Callable:
    """``fn`` with a code object of its own: dynamo keeps its graphs per code object, so
    each engine's are apart from every other engine's in the process."""
    code = fn.__code__.replace()
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _attend(layer: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    return torch.ops.warmboot.paged_attention(q, k, v, layer)


def _region_key(layer, x: torch.Tensor, positions: torch.Tensor) -> int:
    return layer.region_key


def _keyed_region(fn: Callable) -> Callable:
    """``fn`` as a nested compile region keyed by ``_region_key`` where torch takes a key
    (``reuse_hash_fn``: not in 2.11, the GPU image's, whose CUDA steps run uncompiled)."""
    params = inspect.signature(torch.compiler.nested_compile_region).parameters
    if "reuse_hash_fn" not in params:
        return torch.compiler.nested_compile_region(fn)
    return torch.compiler.nested_compile_region(
        fn, reuse_hash_fn=_region_key, max_reuse_entries=256
    )


@_keyed_region
def _layer_step(layer, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One decoder layer, its caches and metadata in the bound context: traced once for all
    layers of one structure (a nested region keyed by ``structure_key``), called per layer."""
    return layer(x, positions, functools.partial(_attend, getattr(layer, STEP_INDEX)))


def structure_key(layer: torch.nn.Module) -> int:
    """What makes two layers one compiled region: every module's type, plain settings (flags,
    sizes, specs) and tensor shapes and dtypes. Dynamo's own reuse test (its guards) let a
    layer reuse another's graph in a model of dense, sparse and NoPE layers (EXAONE-MoE,
    Command A MoE, AFMoE gave other logits); a key of the layer's whole make-up does not."""
    parts = []
    for name, m in layer.named_modules():
        own = itertools.chain(m.named_parameters(recurse=False), m.named_buffers(recurse=False))
        shapes = [(n, tuple(t.shape), str(t.dtype)) for n, t in own if n != STEP_INDEX]
        plain = sorted((k, _plain(v)) for k, v in vars(m).items() if not k.startswith("_"))
        parts.append((name, type(m).__qualname__, shapes, plain))
    return zlib.crc32(repr(parts).encode())


def _plain(value) -> object:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if dataclasses.is_dataclass(value) or isinstance(value, (tuple, list)):
        return repr(value)
    return type(value).__qualname__


def _model_step(model: CausalLM, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """What the step's graph traces: the model's forward, each layer a nested region."""
    return model(ids, positions, None, _layer_step)


def _head_step(model: CausalLM, hidden: torch.Tensor) -> torch.Tensor:
    return model.compute_logits(hidden)


def packed_view(model: CausalLM, table: PackedLinears, pack: bool = True) -> CausalLM:
    """The same model (a copy of its modules sharing every tensor) whose experts run as the
    opaque ``fused_experts`` op (slot ``i`` of a layer: its ``i``-th ``FusedExperts``) and,
    with ``pack``, whose linears compute through ``PackedMethod``: slot ``i`` of a layer is
    its ``i``-th ``Linear``, packed into ``table`` (copies of the weights in oneDNN's
    layout); the LM head is ``HEAD_SLOT``."""
    shared = itertools.chain(model.parameters(), model.buffers(), [model.cfg])
    memo = {id(t): t for t in shared}
    view = copy.deepcopy(model, memo)
    for i, layer in enumerate(view.layers):
        _number(layer, i)
        layer.region_key = structure_key(layer)
        experts = [m for m in layer.modules() if isinstance(m, FusedExperts)]
        table.experts.append([ExpertTable(m, pack, table.kernel) for m in experts])
        for slot, module in enumerate(experts):
            module.method = OpExperts(slot)
        if pack:
            linears = [m for m in layer.modules() if isinstance(m, Linear) and m.method.packable]
            table.add_layer(linears)
            for slot, linear in enumerate(linears):
                linear.method = PackedMethod(slot)
            for mlp in (m for m in layer.modules() if isinstance(m, GatedMLP)):
                # NOTE: an adapter on gate/up adds to the projection before the activation
                packed = mlp.gate_up_proj.method.packable and mlp.gate_up_proj.lora_index is None
                mlp.fused_silu = (
                    packed and mlp.act is F.silu and native_silu(mlp.gate_up_proj.weight.dtype)
                )
    if pack and view.lm_head.method.packable:
        table.set_head(view.lm_head.weight, view.lm_head.bias)
        view.lm_head.method = PackedMethod(HEAD_SLOT)
        view.lm_head.register_buffer(STEP_INDEX, torch.tensor(-1), persistent=False)
    return view.eval()


def _number(layer: torch.nn.Module, i: int) -> None:
    """Decoder layer ``i``, its linears, experts and other modules calling a step op
    (``calls_step_op``) carry ``i`` (one tensor) as ``STEP_INDEX``."""
    index = torch.tensor(i)  # NOTE: on the CPU: the ops read it on the host
    for module in layer.modules():
        ops = isinstance(module, (Linear, FusedExperts, StateMixer))
        if module is layer or ops or getattr(module, "calls_step_op", False):
            module.register_buffer(STEP_INDEX, index, persistent=False)


_THREAD = threading.local()


def _allow_entries() -> None:
    """Every engine of a process traces the same code objects, and each model (shape,
    architecture, dtype) adds a cache entry: tests build dozens. Dynamo's limits are
    per thread (the device thread's, a background compile's), so each sets its own."""
    if not getattr(_THREAD, "limits_set", False):
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, 256)
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4096)
        _THREAD.limits_set = True


def _symbolic_rows(*tensors: torch.Tensor) -> None:
    """Dim 0 as an unbacked size: dynamo then neither specialises nor guards on 1 rows."""
    for t in tensors:
        torch._dynamo.decorators.mark_unbacked(t, 0)
