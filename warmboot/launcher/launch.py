"""Boot or restore: the launcher's decision, playing the seed's "checkpoint service + shim".

1. Compute the process key (tier-A fields that matter plus runsc version, CPU flags and the
   sandbox spec).
2. The store holds a process image for it: fetch, ``runsc restore``, send the fresh settings,
   check the canary, serve  -> ``restored_process``.
3. Otherwise: ``runsc run`` a worker (which boots from tier A when it can), let it shrink its
   KV pool, checkpoint it, restore it from the fresh image (``--leave-running`` does not work
   with this runsc), check the canary, publish the image, serve.
4. Anything failing on the way, or no runsc, or ``sandbox="none"``: the engine boots
   in-process (tier A if it can). The reason is kept and shown in ``/health`` and ``/metrics``.

Settings sent *after* a restore, never baked into the image: the sampling seed and the KV pool
size (``start`` frame). Everything else (model, dtype, lengths) is part of the key.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import sys
import time
import uuid
from dataclasses import dataclass, field, replace
from importlib import metadata
from pathlib import Path

from warmboot.launcher import process_image
from warmboot.launcher.remote import Channel, LaunchInfo, RemoteLLM, WorkerError
from warmboot.snapshot.canary import canary_mismatch

log = logging.getLogger("warmboot")


@dataclass(frozen=True)
class LaunchConfig:
    engine: dict
    """``LLM`` keyword arguments (``model`` included; ``snapshot_store`` for tier A)."""
    store: str | None = None
    """Where process images live (the tier-A store); None disables tier P."""
    sandbox: str = "auto"
    """auto (runsc when available), runsc (same, but say loudly when it is not), none."""
    work_dir: Path = field(default_factory=lambda: Path("/tmp/warmboot-launcher"))
    seed: int = 0
    boot_timeout: float = 600.0
    restore_timeout: float = 120.0
    """A restore (to a started, canary-checked worker) that takes longer falls back."""
    publish: bool = True


def launch(cfg: LaunchConfig):
    """An ``EngineClient``: a restored or fresh sandboxed worker, or the in-process engine."""
    t0 = time.monotonic()
    if cfg.sandbox == "none":
        return _in_process(cfg, "sandbox disabled (--sandbox none)", t0)
    if cfg.store is None:
        return _in_process(cfg, "no snapshot store: nothing to restore from", t0)
    if "://" in str(cfg.store) and not str(cfg.store).startswith("file://"):
        why = "process snapshots need a local store (the sandbox has no network)"
        return _in_process(cfg, f"{why}; tier A from {cfg.store}", t0)
    if _wants_gpu(cfg):
        why = "this host's runsc cannot run GPU workloads"
        return _in_process(cfg, f"{why}; tier A on the GPU", t0, ("gpu_host",))
    from warmboot.launcher.sandbox import runsc_status

    version, why = runsc_status()
    if version is None:
        return _in_process(cfg, f"runsc unavailable: {why}", t0, ("runsc_unavailable",))
    from warmboot.snapshot.store import open_store

    store = open_store(cfg.store)
    spec = worker_spec(cfg)
    fields = process_key_fields(cfg, version, spec)
    key = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]
    try:
        client = _try_restore(cfg, store, key, spec, t0)
        if client is not None:
            return client
        reason = f"no process snapshot for key {key[:12]}"
        fallbacks: tuple[str, ...] = ()
    except Exception as e:  # noqa: BLE001 - any failure of a restore means a cold boot
        reason = f"process snapshot {key[:12]} unusable: {e}"
        fallbacks = ("canary_mismatch" if "canary mismatch" in str(e) else "restore_failed",)
        log.warning("%s; discarding it and booting cold", reason)
        try:
            process_image.discard(store, key)
        except OSError as e:  # a read-only or full store: the cold boot goes on regardless
            log.warning("could not discard process snapshot %s: %s", key[:12], e)
    try:
        client = _create(cfg, store, key, fields, spec, reason, t0)
    except Exception as e:  # noqa: BLE001 - the in-process boot is the last resort
        log.warning("sandboxed boot failed (%s); booting in-process", e)
        fallbacks += ("sandboxed_boot_failed",)
        return _in_process(cfg, f"{reason}; sandboxed boot failed: {e}", t0, fallbacks)
    client.start_info = replace(client.start_info, fallbacks=fallbacks)
    return client


# -- paths ---------------------------------------------------------------------------------------
def _try_restore(cfg: LaunchConfig, store, key: str, spec, t0: float) -> RemoteLLM | None:
    manifest = process_image.lookup(store, key)
    if manifest is None:
        return None
    work = _work_dir(cfg)
    try:
        image = work / "image"
        t_fetch = time.monotonic()
        nbytes = process_image.fetch(store, manifest, image)
        phases = {"fetch_image": time.monotonic() - t_fetch}
        client = _restore_and_start(cfg, spec, work, image, manifest["canary"], phases)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    reason = f"process snapshot {key[:12]} restored ({nbytes / 1e6:.0f} MB image), canary ok"
    return _finish(client, "restored_process", reason, phases, t0)


def _create(cfg: LaunchConfig, store, key: str, fields: dict, spec, reason: str, t0: float):
    work = _work_dir(cfg)
    phases: dict[str, float] = {}
    try:
        return _boot_checkpoint_publish(cfg, store, key, fields, spec, reason, t0, work, phases)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def _boot_checkpoint_publish(cfg, store, key, fields, spec, reason, t0, work, phases):
    from warmboot.launcher.sandbox import Sandbox

    sandbox = Sandbox(spec, work / "boot")
    try:
        t = time.monotonic()
        proc = sandbox.run()
        channel = Channel(proc.stdin, proc.stdout, "sandboxed worker")
        channel.expect("booted", cfg.boot_timeout)
        phases["sandboxed_boot"] = time.monotonic() - t
        channel.send({"t": "prepare_checkpoint"})
        canary = channel.expect("quiescent", 120)["canary"]
        image = work / "image"
        phases["checkpoint"] = sandbox.checkpoint(image)
    finally:
        sandbox.delete()
    client = _restore_and_start(cfg, spec, work, image, canary, phases)
    if cfg.publish:
        t = time.monotonic()
        meta = {"fields": fields, "canary": canary, "image_bytes": process_image.image_bytes(image)}
        new = process_image.publish(store, key, image, meta)
        phases["publish_image"] = time.monotonic() - t
        log.info("published process snapshot %s (%.0f MB new)", key[:12], new / 1e6)
    return _finish(client, "cold", f"{reason}; booted in gVisor and published", phases, t0)


def _restore_and_start(cfg, spec, work: Path, image: Path, canary: list, phases: dict):
    """``runsc restore`` the image, send the fresh settings, check the canary."""
    from warmboot.launcher.sandbox import Sandbox
    from warmboot.tokenizer import Tokenizer

    sandbox = Sandbox(spec, work / "serve")
    t = time.monotonic()
    try:
        proc = sandbox.restore(image, timeout=cfg.restore_timeout)
        channel = Channel(proc.stdin, proc.stdout, "restored worker")
        phases["runsc_restore"] = time.monotonic() - t
        t = time.monotonic()
        channel.send({"t": "start", "seed": cfg.seed})
        started = channel.expect("started", cfg.restore_timeout)
        phases["start_and_canary"] = time.monotonic() - t
        phases["canary"] = started["canary_s"]
        why = canary_mismatch(canary, started["canary"])
        if why is not None:
            raise WorkerError(f"canary mismatch: {why}")
    except BaseException:
        sandbox.delete()
        raise
    tokenizer = Tokenizer.from_dir(cfg.engine["model"])
    client = RemoteLLM(channel, tokenizer, started, LaunchInfo("pending", ""))
    client.on_exit(lambda: _reap(sandbox, proc, work))
    return client


def _finish(client: RemoteLLM, path: str, reason: str, phases: dict, t0: float):
    client.start_info = LaunchInfo(path, reason, time.monotonic() - t0, dict(phases))
    log.info("worker ready via %s (%s): %s", path, reason, _fmt(phases))
    return client


def _in_process(cfg: LaunchConfig, reason: str, t0: float, fallbacks: tuple[str, ...] = ()):
    from warmboot import LLM
    from warmboot.engine.async_llm import AsyncLLM

    engine = LLM(**cfg.engine).engine
    info = engine.start_info
    front = AsyncLLM(engine)
    front.start_info_override = LaunchInfo(
        info.path,
        f"{reason}; in-process: {info.reason}",
        time.monotonic() - t0,
        info.phase_times,
        fallbacks,
    )
    return front


def _reap(sandbox, proc, work: Path) -> None:
    """The worker is told to stop: wait for it, delete its container, drop the image copy."""
    try:
        proc.wait(timeout=10)
    except Exception:  # noqa: BLE001 - it is going away either way
        pass
    sandbox.delete()
    shutil.rmtree(work, ignore_errors=True)


# -- the worker and its key ------------------------------------------------------------------
def worker_spec(cfg: LaunchConfig):
    from warmboot.launcher.sandbox import SandboxSpec

    keep = ("PATH", "LANG", "WARMBOOT_CACHE", "PYTHONPATH", "OMP_NUM_THREADS")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env["PYTHONUNBUFFERED"] = "1"
    binds = []
    store = cfg.engine.get("snapshot_store")
    if store and "://" not in str(store):  # the worker publishes tier A into a local store
        Path(store).mkdir(parents=True, exist_ok=True)
        binds.append(str(Path(store).resolve()))
    # NOTE: -P: the working directory is not put first on sys.path, so a json.py (or any
    # module) lying there cannot shadow the standard library inside the sandbox
    argv = [sys.executable, "-P", "-m", "warmboot.launcher.worker",
            json.dumps(sandboxed(cfg.engine))]  # fmt: skip
    # NOTE: the scratch tmpfs (captured in the image) sits on a fixed, otherwise empty path:
    # a tmpfs over /tmp would hide models and stores that live there.
    scratch = Path(cfg.work_dir).resolve() / "scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    env["HOME"] = str(scratch)  # NOTE: tools' caches land in the captured tmpfs, and the
    # host's ~/.cache (models, stores) stays visible
    return SandboxSpec(
        argv=argv,
        cwd=os.getcwd(),
        env=env,
        writable_binds=tuple(binds),
        tmpfs=(str(scratch),),
    )


def sandboxed(engine: dict) -> dict:
    """Engine settings inside gVisor: one torch thread unless told otherwise. gVisor traps the
    futexes torch's intra-op pool syncs with around every op: two threads decoded the demo
    model 3.7x slower than one at batch 16, and one is as fast as natively
    (docs/benchmarks/sandbox_threads.md)."""
    if engine.get("cpu_threads") is not None:
        return engine
    return {**engine, "cpu_threads": 1}


def process_key_fields(cfg: LaunchConfig, runsc_version: str, spec) -> dict[str, str]:
    """Everything that can change the restored process: model files, engine settings,
    versions, CPU, runsc, and the sandbox spec itself."""
    from warmboot.snapshot.key import model_files_digest, source_digest

    cpu = _cpu_flags()
    return {
        "model_files": model_files_digest(Path(cfg.engine["model"])),
        "engine": json.dumps(cfg.engine, sort_keys=True),
        "warmboot": metadata.version("warmboot"),
        "warmboot_source": source_digest(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "triton": _version("triton"),
        "runsc": runsc_version,
        "cpu": cpu,
        "sandbox_spec": json.dumps(
            {"argv": spec.argv, "cwd": spec.cwd, "env": spec.env, "binds": spec.writable_binds},
            sort_keys=True,
        ),
    }


def _wants_gpu(cfg: LaunchConfig) -> bool:
    """The engine would run on a GPU: asked for, or ``auto`` on a host with an NVIDIA driver.
    (Checked without importing torch.)"""
    device = str(cfg.engine.get("device", "auto"))
    if device.startswith("cuda"):
        return True
    return device == "auto" and Path("/proc/driver/nvidia/version").exists()


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine()
    model = flags = ""
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "model name" and not model:
            model = value.strip()
        elif name.strip() == "flags" and not flags:
            flags = " ".join(sorted(value.split()))
    return f"{model} | {flags}"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def _work_dir(cfg: LaunchConfig) -> Path:
    path = Path(cfg.work_dir) / uuid.uuid4().hex[:12]
    path.mkdir(parents=True, exist_ok=True)
    return path


def _fmt(phases: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.2f}s" for k, v in phases.items())
