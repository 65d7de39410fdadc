"""Which CPU step serves, chosen by measurement: compiled with the native bf16 GEMM (with or
without a helper thread on the host's core), compiled with oneDNN's, or eager.

What is fastest depends on the machine and the model: the native GEMM streams weights at
memory speed on AVX-512 BF16 (``kernels.native``), oneDNN has AMX kernels on the Xeons that
have them, a helper thread gains what the host's core leaves idle (a core's read bandwidth
where memory has more to give, nothing where the core is busy or memory saturated), and a
small model on a slow host may not gain from the compiled step at all. So a
cold start, once the steps are compiled, times each candidate on scratch decode steps (they
read and write only the scratch block) at one row and at ``BATCH`` rows, and keeps the one
with the lowest geometric mean; eager wins only by being faster, so the choice is never
slower than eager where it was measured. Before that, ``dense_rows`` finds the row count
from which the native GEMM gives way to torch's (oneDNN's blocking wins at prefill sizes,
and from a few rows where neither AVX-512 BF16's nor AMX's path suits the CPU). About two
seconds on the demo model.

The choice is a fact of the tier-A snapshot (``step_choice``): a restore applies it without
measuring, and one that chose eager skips the compile. Where the mode is unsaid, a cold start
on the CPU serves eager steps at once and compiles and measures in the background (as a
restore does), so it is as quick to its first token as an eager one.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from dataclasses import asdict, dataclass, field

import torch

from warmboot.device.compiled import CompiledSteps, scratch_decode
from warmboot.kernels.step_ops import (
    PackedLinears,
    StepContext,
    native_gemm,
    onednn_bf16,
    packed_gemm,
)

log = logging.getLogger(__name__)

BATCH = 16
PROBES = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
"""Row counts ``dense_rows`` times the native GEMM and torch's at."""
REPEATS = 3
MODES = ("compiled", "eager")
KERNELS = ("native", "onednn")


@dataclass
class StepChoice:
    mode: str = "compiled"
    """``compiled`` or ``eager``."""
    kernel: str = "native"
    """The compiled step's bf16 GEMM: ``native`` or ``onednn``."""
    helpers: int = 0
    """Helper threads lent to the native kernels (``CpuStream.lend_helpers``: then each
    step is lent them or not, whichever has been faster of late, ``device.helper_arms``)."""
    dense_rows: int | None = None
    """From this many rows on, the native kernel's GEMMs run on torch's GEMM with the model's
    own weights (``PackedLinears.dense_rows``: measured by ``dense_rows``)."""
    ms_per_step: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per candidate (``compiled/native``, ``compiled/native+helper``, ``compiled/onednn``,
    ``eager``): ms per scratch decode step by row count."""
    source: str = "measured"
    """``measured`` here, or ``recorded`` (a snapshot's)."""

    def as_fact(self) -> dict:
        return asdict(self)

    @classmethod
    def from_fact(cls, fact: object) -> StepChoice | None:
        """A snapshot's fact, or None where it is malformed (data, never trusted)."""
        if not isinstance(fact, dict):
            return None
        mode, kernel, helpers = fact.get("mode"), fact.get("kernel"), fact.get("helpers", 0)
        if mode not in MODES or kernel not in KERNELS or helpers not in (0, 1):
            return None
        rows = fact.get("dense_rows")
        if rows is not None and (type(rows) is not int or rows not in PROBES):
            return None
        return cls(mode, kernel, helpers, rows, {}, "recorded")


def choose(runner, steps: CompiledSteps, allow_eager: bool = True) -> StepChoice:
    """Time the candidates with ``steps`` (compiled and warmed, not serving yet) and eager
    where ``allow_eager`` (not where compiled steps were asked for); ``steps`` keeps the
    fastest kernel, and the caller serves with them or eagerly as the choice says. The timed
    steps run on the device thread, between serving ones."""
    table = steps.linears
    kernels = KERNELS
    if not _has_native_gemm(runner):  # NOTE: then every weight is in oneDNN's layout already
        table.kernel, kernels = "onednn", ("onednn",)
    elif runner.dtype == torch.bfloat16 and not onednn_bf16():  # NOTE: an AVX2-only CPU
        kernels = ("native",)
    if "native" in kernels:
        table.use("native")
        table.set_dense_rows(dense_rows(runner, table))
    times = {}
    for kernel in kernels:
        table.use(kernel)
        times[f"compiled/{kernel}"] = _time_steps(runner, steps)
        if kernel == "native" and runner.stream.lend_helpers(1, always=True):
            times["compiled/native+helper"] = _time_steps(runner, steps)
            runner.stream.lend_helpers(0)
    if allow_eager:
        times["eager"] = _time_steps(runner, None)
    best = min(times, key=lambda name: _geomean(times[name].values()))
    mode, _, kernel = best.partition("/")
    kernel, helper, _ = kernel.partition("+")
    choice = StepChoice(mode, kernel or table.kernel, int(bool(helper)), table.dense_rows, times)
    table.use(choice.kernel)
    log.info("step choice: %s (ms per step: %s)", best, times)
    return choice


def dense_rows(runner, table: PackedLinears) -> int | None:
    """The fewest rows (of ``PROBES``) from which torch's GEMM on the model's own weights
    (``dense_linear``: ``F.linear`` in row blocks a helper may share, as the step runs it)
    beats the native GEMM on the first layer's linears, at that probe and every larger one;
    None where it never does. Timed on the device thread (a few tenths of a second: the
    larger probes are prefill-sized)."""
    pairs = [
        (w, table.source(0, slot))
        for slot, (w, _) in enumerate(table.layers[0] if table.layers else ())
        if w is not None and w.dim() == 4
    ]
    if not pairs:
        return None
    wins: dict[int, bool] = {}

    @torch.inference_mode()
    def probe() -> None:
        for rows in PROBES:
            packed = plain = 0.0
            for w, src in pairs:
                x = torch.randn(rows, src.shape[1], dtype=src.dtype)
                packed += _best(functools.partial(packed_gemm, x, w, None, src.shape[0]))
                plain += _best(functools.partial(_dense, x, src))
            wins[rows] = plain < packed

    runner.stream.submit(probe)
    runner.stream.record().wait()
    found = None
    for rows in reversed(PROBES):
        if not wins[rows]:
            break
        found = rows
    log.info("dense GEMM from %s rows (probes: %s)", found, wins)
    return found


def _dense(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.warmboot_cpu.dense_linear(x, weight, None)


def _best(fn, repeats: int = REPEATS) -> float:
    fn()  # NOTE: a warm-up, left out
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _has_native_gemm(runner) -> bool:
    return any(native_gemm(p) for p in runner.model.parameters() if p.dim() == 2)


def _time_steps(runner, steps: CompiledSteps | None) -> dict[str, float]:
    """ms per decode step at 1 and ``BATCH`` scratch rows, on the device thread."""
    out = {}
    for rows in (1, BATCH):
        meta = scratch_decode(
            rows,
            runner.block_size,
            runner.scratch_block,
            runner.block_size,
            runner.device,
            runner.scratch_state_slot,
        )
        ids = torch.zeros(rows, dtype=torch.int64, device=runner.device)
        positions = torch.full_like(ids, runner.block_size - 1)
        samples: list[float] = []
        timed = functools.partial(_timed, _step_fn(runner, steps, ids, positions, meta), samples)
        for _ in range(REPEATS + 1):  # NOTE: the first is a warm-up, left out
            runner.stream.submit(timed)
        runner.stream.record().wait()
        out[str(rows)] = 1e3 * min(samples[1:])
    return out


def _timed(step, samples: list[float]) -> None:
    t0 = time.perf_counter()
    step()
    samples.append(time.perf_counter() - t0)


def _step_fn(runner, steps: CompiledSteps | None, ids, positions, meta):
    """One scratch step: ``steps``' graphs, or eager (None)."""
    if steps is not None:
        return lambda: steps.logits(steps.hidden(ids, positions, meta))
    model = runner.model
    states = runner.state_caches
    ctx = StepContext(runner.attention, runner.kv_caches, meta, runner.specs, states=states)
    return lambda: model.compute_logits(model(ids, positions, ctx))


def _geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))
