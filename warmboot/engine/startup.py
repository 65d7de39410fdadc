"""Start-up as explicit, timed phases, and the idle-engine operations that redo some of them.

    config -> tokenizer -> [snapshot_key -> snapshot_lookup -> restore_weights] | load_weights
    -> allocate_kv -> warmup (the canary; a restored image whose canary differs boots cold)
    -> [compile] (on CUDA before the warm-up) -> [autotune] -> [cuda_graphs]
    -> [snapshot_publish] -> ready

``compile`` traces and compiles the model steps (``device.compiled``), in the background
while eager steps serve after a restore, or a cold start whose mode is unsaid and that has
nothing to publish; then ``device.step_choice`` measures which step serves.

Every phase is logged as it begins and ends (``engine.progress``; a bar while weights load
or restore) and timed into ``Startup.times`` (``stats()["startup_times"]``); the engine's
``start_info`` says which path it took and why.

``close`` waits for a background compile and frees an engine's runner; every live one is
closed at exit (``engine.shutdown``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from warmboot.architectures import ARCHITECTURES
from warmboot.config import EngineConfig, ModelConfig, ModelFilesError, SchedulerConfig
from warmboot.core.block_manager import BlockManager
from warmboot.device.runner import ModelRunner
from warmboot.device.step_choice import StepChoice
from warmboot.engine import memory, progress, shutdown
from warmboot.engine import settings as resolve
from warmboot.engine.background_compile import ModelCompile
from warmboot.engine.settings import RuntimeFacts, Settings
from warmboot.engine.startup_graphs import GraphPhases
from warmboot.kernels import native
from warmboot.kernels.backend import KVLayout
from warmboot.lora.registry import LoraRegistry
from warmboot.lora.targets import LoraTargets
from warmboot.models.checkpoint import check_servable, checkpoint_files
from warmboot.models.quant_config import ONLINE
from warmboot.snapshot import start_costs
from warmboot.snapshot.canary import run_canary
from warmboot.snapshot.compile_artifacts import saved_artifacts
from warmboot.tokenizer import Tokenizer

if TYPE_CHECKING:
    from warmboot.snapshot.boot import SnapshotBoot

log = logging.getLogger("warmboot.startup")


@dataclass(frozen=True)
class StartInfo:
    """How the engine started: ``path`` is "cold" or "restored_image" (a tier-A snapshot)."""

    path: str
    reason: str
    """Why that path: the matching snapshot, or why none was used."""
    ready_s: float
    """Seconds from the start of ``LLMEngine.__init__`` to ready (publishing included)."""
    phase_times: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Booted:
    """What the first phases hand to the engine."""

    model_config: ModelConfig
    settings: Settings
    tokenizer: Tokenizer
    runner: ModelRunner
    facts: RuntimeFacts


class BootingEngine(Protocol):
    """What the late phases need of the engine they finish (an ``LLMEngine``)."""

    runner: ModelRunner
    block_manager: BlockManager
    facts: RuntimeFacts
    settings: Settings
    sched_config: SchedulerConfig

    def add_request(self, request_id: str | None, prompt: Any, params: Any = None) -> str: ...

    def step(self) -> list: ...

    def has_unfinished_requests(self) -> bool: ...


class Startup(GraphPhases):
    """One engine's start-up: runs the phases, keeps their times and the snapshot decision."""

    def __init__(self, config: EngineConfig):
        self.t0 = time.perf_counter()
        self.config = config
        self.model_dir = Path(config.model)
        self.times: dict[str, float] = {}
        self.snapshot: SnapshotBoot | None = None
        self.restored = False
        self.model_class: tuple[str, str] | None = None
        """The family module and class serving the model (part of the snapshot key)."""
        self.graphs_note = "off"
        """CUDA graphs: on, off, emulated (CPU tests), or off with the capture's error."""
        self.compiling = ModelCompile(self.phase, self.t0)
        """The model steps' compile (``compile``): ``compiling.info`` says what it did."""
        self.runner: ModelRunner | None = None
        self.closed = False
        shutdown.track(self)

    @contextmanager
    def phase(
        self, name: str, total: int | None = None, detail: str = ""
    ) -> Iterator[progress.Advance]:
        """Time phase ``name`` into ``times`` and report it (``progress.phase``)."""
        t0 = time.perf_counter()
        with progress.phase(name, total, detail) as advance:
            yield advance
        self.times[name] = time.perf_counter() - t0

    def close(self) -> None:
        """Wait for a background compile, then free the runner (``ModelRunner.close``)."""
        if self.closed:
            return
        self.closed = True
        shutdown.forget(self)
        self.wait_compiled()
        if self.runner is not None:
            self.runner.close()

    # -- up to an engine with weights and a KV pool ---------------------------------------------
    def boot(self) -> Booted:
        config = self.config
        with self.phase("config"):
            if not self.model_dir.is_dir():
                raise ModelFilesError(f"model directory {self.model_dir} does not exist")
            model_config = ModelConfig.from_dir(self.model_dir)
            check_servable(self.model_dir, model_config, config.quantization)
            self.model_class = ARCHITECTURES[model_config.architecture]
            settings = resolve.resolve(config, model_config)
        with self.phase("tokenizer"):
            tokenizer = Tokenizer.from_dir(self.model_dir)
            eos = resolve.eos_ids(self.model_dir, model_config, tokenizer)
        torch.manual_seed(config.seed)
        attention = resolve.attention_backend(
            config.attention_backend, settings.device, lambda: _kv_layout(model_config)
        )
        runner = self.runner = self._runner(model_config, settings, attention)
        self.snapshot = self._open_snapshot(settings, attention.name)
        self.restored = self._restore_pays() and self.restore_weights(runner)
        if not self.restored:
            self.load_weights(runner)
        elif settings.device.type == "cpu":
            with self.phase("native_library"):
                log.info("%s", self.snapshot.native_library())
        if config.lora.enable_lora:
            runner.inputs.lora = lora_registry(config, runner)
        with self.phase("allocate_kv"):
            checkpoints = memory.state_checkpoints(self.config.cache, runner, settings)
            num_blocks = memory.num_kv_blocks(self.config.cache, runner, settings, checkpoints)
            runner.allocate_kv_cache(num_blocks, checkpoints)
        facts = RuntimeFacts(
            device=str(settings.device),
            dtype=str(settings.dtype).removeprefix("torch."),
            num_kv_blocks=num_blocks,
            max_model_len=settings.scheduler.max_model_len,
            eos_token_ids=eos,
            attention_backend=attention.name,
            kv_bytes_per_token=runner.kv_bytes_per_token(),
        )
        return Booted(model_config, settings, tokenizer, runner, facts)

    def load_weights(self, runner: ModelRunner) -> None:
        files = checkpoint_files(self.model_dir)
        total = sum(f.stat().st_size for f in files)
        with self.phase("load_weights", total) as advance:
            runner.load_model(self.model_dir, advance, self.config.quantization)

    def _runner(self, model_config: ModelConfig, settings: Settings, attention) -> ModelRunner:
        sched = settings.scheduler
        return ModelRunner(
            model_config,
            settings.dtype,
            settings.device,
            attention,
            self.config.cache.block_size,
            num_request_slots=2 * sched.max_num_seqs + 2,
            max_model_len=sched.max_model_len,
            max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            cpu_threads=settings.cpu_threads,
        )

    def _open_snapshot(self, settings: Settings, attention: str) -> SnapshotBoot | None:
        if self.config.snapshot_store is None:
            return None
        from warmboot.snapshot.boot import SnapshotBoot

        sched = settings.scheduler
        key_settings = {
            "dtype": str(settings.dtype).removeprefix("torch."),
            "device_type": settings.device.type,
            "block_size": self.config.cache.block_size,
            "max_model_len": sched.max_model_len,
            "max_num_seqs": sched.max_num_seqs,
            "max_num_batched_tokens": sched.max_num_batched_tokens,
            "attention_backend": attention,
            "compiled": settings.compiled,
            "model_class": ".".join(self.model_class),
        }
        if self.config.quantization in ONLINE:  # NOTE: a full-precision model quantized at load
            key_settings["quantization"] = self.config.quantization
        store, device = self.config.snapshot_store, settings.device
        with self.phase("snapshot_key"):
            timeout = self.config.snapshot_timeout
            return SnapshotBoot(store, self.model_dir, key_settings, device, timeout)

    def _restore_pays(self) -> bool:
        """False where a cold start measured quicker for this key (``start_costs``), or is
        tried to measure it (once, and again while a close call): on the CPU only (on CUDA a
        cold start compiles first)."""
        snap = self.snapshot
        explore = bool(snap) and snap.device.type == "cpu"
        why = snap and start_costs.cold_is_quicker(snap.key, explore, snap.store)
        if why:
            self.snapshot.reason, self.snapshot.publish_skipped = why, True
        return not why

    def restore_weights(self, runner: ModelRunner, mapped: bool = False) -> bool:
        """Restore the runner's weights from a matching snapshot; False (reason logged) if none.
        ``mapped``: map the chunk files rather than copy them (see ``SnapshotBoot.restore``)."""
        snap = self.snapshot
        if snap is None:
            return False
        with self.phase("snapshot_lookup"):
            manifest = snap.lookup()
        if manifest is not None:
            total = manifest.tensor_bytes
            with self.phase("restore_weights", total) as advance:
                tensors = snap.restore(manifest, runner.dtype, mapped, advance)
                if tensors is not None:
                    try:
                        source = f"snapshot {manifest.key}"
                        runner.install_weights(tensors, source, self.config.quantization)
                    except Exception as e:  # noqa: BLE001 - a manifest is data: any misfit
                        snap.reason = f"snapshot {manifest.key} does not fit: {_describe(e)}"
                        tensors = None
            if tensors is not None:
                return True
        log.info("snapshot not used, booting cold: %s", snap.reason)
        return False

    # -- from a booted engine to ready ---------------------------------------------------------
    def finish(self, engine: BootingEngine) -> StartInfo:
        """Compile, warm up (checking a restored image's canary), tune, capture, publish."""
        # NOTE: on the CPU the canary runs before the compile, so a publishing cold boot and a
        # restore (whose compile runs in the background) record and check the same eager steps;
        # on CUDA after it (CUDA graphs capture compiled steps)
        on_cpu = engine.runner.device.type == "cpu"
        if not on_cpu:
            self.compile(engine)
        canary = self._warmup(engine)
        if self.restored and not self.snapshot.canary_matches(canary, engine.runner.dtype):
            self.restored = False
            log.warning("snapshot canary failed (%s); booting cold", self.snapshot.reason)
            self.wait_compiled()
            self.load_weights(engine.runner)
            if not on_cpu:
                self.compile(engine)
            canary = self._warmup(engine)
        if on_cpu:
            quick = resolve.mode_unsaid(self.config.enforce_eager) and not self._publishing()
            self.compile(engine, background=self.restored or quick)
        publishing = self._publishing()
        self._pretune(engine, publishing)
        if engine.settings.cuda_graphs:
            with self.phase("cuda_graphs"):
                self.capture_graphs(engine, required=bool(self.config.cuda_graphs))
        if publishing:
            with self.phase("snapshot_publish"):
                facts = asdict(engine.facts) | {"canary": canary, "cold_boot": dict(self.times)}
                if "step_choice" in self.compiling.info:
                    facts["step_choice"] = self.compiling.info["step_choice"]
                artifacts = saved_artifacts() if engine.settings.compiled else None
                self.snapshot.publish(engine.runner.model, facts, artifacts)
        return self._ready()

    def _warmup(self, engine: BootingEngine) -> list[tuple[int, float]]:
        if self._publishing() and _native_canary(engine.runner):
            # NOTE: the canary a publisher records is run on the kernels it serves with: a
            # first build of the native library would else leave it to torch's attention
            # (``native.ready``), and a restore, which has the library, would not match
            with self.phase("native_build"):
                native.library()
        with self.phase("warmup"):
            canary = run_canary(engine)
            engine.block_manager.check_invariants()
        return canary

    def compile(self, engine: BootingEngine, background: bool = False, again: bool = False) -> None:
        """Trace and compile the model steps (``again`` after the weights change); a restored
        image's compile artifacts are loaded first, so inductor's caches hit. ``background``:
        eager steps serve until the compiled ones are ready. The step that serves is the one
        a restored image recorded or, ``again``, the one chosen before (the weights moved, the
        machine did not: 44 s of the 1.5B model's publishing boot in gVisor), else measured
        (``device.step_choice``)."""
        if not engine.settings.compiled:
            return
        artifacts = self.snapshot.compile_artifacts if self.restored else None
        manifest = self.snapshot.manifest if self.restored else None
        recorded = StepChoice.from_fact(manifest.facts.get("step_choice")) if manifest else None
        before = self.compiling.info.get("step_choice") if again else None
        recorded = StepChoice.from_fact(before) or recorded
        # NOTE: enforce_eager=False asks for compiled steps: then only the kernel is chosen
        allow_eager = resolve.mode_unsaid(self.config.enforce_eager)
        if recorded is not None and recorded.mode == "eager" and allow_eager:
            self.compiling.info = {"compiled": False, "step_choice": recorded.as_fact()}
            return
        self.compiling.start(engine.runner, artifacts, background, recorded, allow_eager)
        if before and self.compiling.info.get("step_choice"):  # NOTE: as measured here
            self.compiling.info["step_choice"] = before

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait for a background compile; True when the compiled steps run (or none)."""
        return self.compiling.wait(timeout)

    def _pretune(self, engine: BootingEngine, publishing: bool) -> None:
        runner = engine.runner
        device, backend = runner.device, runner.attention.name
        if resolve.wants_pretune(self.config.pretune_attention, device, backend, publishing):
            with self.phase("autotune"):
                sched = engine.sched_config
                shapes = runner.pretune_attention(sched.max_num_batched_tokens, sched.max_model_len)
            log.info("attention tuned for %d prefill shapes", shapes)

    def _publishing(self) -> bool:
        snap = self.snapshot
        return bool(snap and not self.restored and self.config.snapshot_publish) and not (
            snap.publish_skipped
        )

    def _ready(self) -> StartInfo:
        reason = self.snapshot.reason if self.snapshot else "no snapshot store configured"
        if self.snapshot and self.snapshot.publish_note:
            reason = f"{reason}; {self.snapshot.publish_note}"
        info = StartInfo(
            path="restored_image" if self.restored else "cold",
            reason=reason,
            ready_s=time.perf_counter() - self.t0,
            phase_times=dict(self.times),
        )
        if self.snapshot:
            start_costs.record(self.snapshot.key, info.path, self.times, self.snapshot.store)
        phases = ", ".join(f"{k} {v:.2f}s" for k, v in self.times.items())
        log.info("engine ready in %.2fs via %s (%s): %s", info.ready_s, info.path, reason, phases)
        return info


def _native_canary(runner: ModelRunner) -> bool:
    """Whether a canary must wait for the native library: in half precision on the CPU,
    where its kernels and torch's differ by a step of bf16 (in float32 by far less than the
    canary's tolerance, and a first build in gVisor takes minutes)."""
    half = runner.dtype in (torch.bfloat16, torch.float16)
    return half and runner.device.type == "cpu" and native.enabled()


def _describe(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"


def _kv_layout(model_config: ModelConfig) -> tuple[KVLayout, int]:
    """The model's KV layout and query heads (its modules built on the meta device)."""
    from warmboot.models.loader import build_model

    return build_model(model_config).kv_layout(), model_config.num_heads


def lora_registry(config: EngineConfig, runner: ModelRunner) -> LoraRegistry:
    """The adapters' registry over the model's adaptable linears (``lora.targets``)."""
    max_loras, lora = config.scheduler.max_loras, config.lora
    targets = LoraTargets(runner.model, max_loras, lora.max_lora_rank, runner.dtype, runner.device)
    return LoraRegistry(targets, lora.max_cpu_loras or max_loras)
