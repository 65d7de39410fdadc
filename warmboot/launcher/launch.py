"""Boot or restore: the launcher's decision, playing the seed's "checkpoint service + shim".

1. Compute the process key (tier-A fields that matter plus runsc version, CPU flags and the
   sandbox spec).
2. The store holds a process image for it: fetch, ``runsc restore``, send the fresh settings,
   check the canary, serve  -> ``restored_process``.
3. Otherwise: ``runsc run`` a worker (which boots from tier A when it can), let it shrink its
   KV pool, checkpoint it, restore it from the fresh image (``--leave-running`` does not work
   with this runsc), check the canary, publish the image, serve.
4. Anything failing on the way, or no runsc, or ``sandbox="none"``: the engine boots outside
   gVisor (tier A if it can), in a plain child process (``engine_process``: ``serve``'s default
   on the CPU) or in this one. The reason is kept and shown in ``/health`` and ``/metrics``.

Settings sent *after* a restore, never baked into the image: the sampling seed and the KV pool
size (``start`` frame). Everything else (model, dtype, lengths) is part of the key.

Every step is a start-up phase (``engine.progress``: logged as it begins and ends, named in
``/health``); a worker relays its engine's phases as frames, which nest under the step that
waits for them (``sandboxed_boot > worker load_weights``).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from warmboot.config import ENGINE_DEFAULTS
from warmboot.engine import progress
from warmboot.launcher import engine_process, local, runsc_image
from warmboot.launcher import spec as spec_mod
from warmboot.launcher.launch_config import LaunchConfig
from warmboot.launcher.remote import Channel, LaunchInfo, RemoteLLM, WorkerError
from warmboot.snapshot import process_image, start_costs
from warmboot.snapshot.canary import canary_mismatch
from warmboot.snapshot.deadline import StoreTimeout, run_with_deadline
from warmboot.snapshot.lease import holder, try_lease

log = logging.getLogger("warmboot.startup")
QUIESCENT_TOTAL_S = 1800.0
"""How long the launcher waits for a sandboxed worker to be ready for its checkpoint while it
reports it is alive (a background compile inside gVisor: minutes); then it boots in-process."""


def launch(cfg: LaunchConfig):
    """An ``EngineClient``: a restored or fresh sandboxed worker, or a local engine (in a
    child process or in this one: ``local``)."""
    t0 = time.monotonic()
    if swept := spec_mod.sweep_leftovers(cfg.work_dir):
        log.info("swept %d work dirs left by launchers that are gone", swept)
    if cfg.sandbox == "none":
        return local.start(cfg, "sandbox disabled (--sandbox none)", t0)
    if cfg.store is None:
        return local.start(cfg, "no snapshot store: nothing to restore from", t0)
    if "://" in str(cfg.store) and not str(cfg.store).startswith("file://"):
        why = "process snapshots need a local store (the sandbox has no network)"
        return local.start(cfg, f"{why}; tier A from {cfg.store}", t0)
    if local.wants_gpu(cfg.engine):
        why = "this host's runsc cannot run GPU workloads"
        return local.start(cfg, f"{why}; tier A on the GPU", t0, ("gpu_host",))
    from warmboot.launcher.sandbox import runsc_status

    version, why = runsc_status()
    if version is None:
        return local.start(cfg, f"runsc unavailable: {why}", t0, ("runsc_unavailable",))
    from warmboot.snapshot.store import open_store

    store = open_store(cfg.store)
    spec = worker_spec(cfg)
    fields = spec_mod.process_key_fields(cfg.engine, version, spec)
    key = spec_mod.process_key(fields)
    if why := start_costs.local_is_quicker(key, store):
        return local.timed(cfg, why, t0, key, store)
    engine_process.drop_spare()  # NOTE: the engine runs in gVisor (or, failing that, anew)
    try:
        client = _try_restore(cfg, store, key, spec, t0)
        if client is not None:
            start_costs.record_launch(key, "restored_process", client.start_info.ready_s, store)
            local.recorded(cfg, key, store)
            return client
        reason = f"no process snapshot for key {key[:12]}"
        fallbacks: tuple[str, ...] = ()
    except Exception as e:  # noqa: BLE001 - any failure of a restore means a cold boot
        reason = f"process snapshot {key[:12]} unusable: {e}"
        fallbacks = ("canary_mismatch" if "canary mismatch" in str(e) else "restore_failed",)
        if isinstance(e, StoreTimeout):  # NOTE: a stalled store says nothing of the image
            log.warning("%s; booting cold", reason)
        else:
            log.warning("%s; discarding it and booting cold", reason)
            _discard(cfg, store, key)
    try:
        client = _create(cfg, store, key, fields, spec, reason, t0)
    except Exception as e:  # noqa: BLE001 - the in-process boot is the last resort
        log.warning("sandboxed boot failed (%s); booting in-process", e)
        fallbacks += ("sandboxed_boot_failed",)
        return local.start(cfg, f"{reason}; sandboxed boot failed: {e}", t0, fallbacks)
    client.start_info = replace(client.start_info, fallbacks=fallbacks)
    return client


# -- paths ---------------------------------------------------------------------------------------
def _try_restore(cfg: LaunchConfig, store, key: str, spec, t0: float) -> RemoteLLM | None:
    with progress.phase("process_image_lookup"):
        manifest = _bounded(cfg, "process image lookup", lambda: process_image.lookup(store, key))
    if manifest is None:
        return None
    work = _work_dir(cfg)
    phases: dict[str, float] = {}
    try:
        image = work / "image"
        with _phase(phases, "fetch_image", process_image.image_total(manifest)) as advance:
            nbytes, linked = run_with_deadline(
                "process image fetch",
                lambda p: process_image.place(store, manifest, image, p),
                _store_timeout(cfg),
                progress=advance,
            )
        verify = functools.partial(_verify, cfg, linked, phases)
        prefetch = functools.partial(process_image.prefetch_mapped, store, manifest)
        client = _restore_and_start(
            cfg, spec, work, image, manifest["canary"], phases, verify, prefetch
        )
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    reason = f"process snapshot {key[:12]} restored ({nbytes / 1e6:.0f} MB image), canary ok"
    return _finish(client, "restored_process", reason, phases, t0)


def _create(cfg: LaunchConfig, store, key: str, fields: dict, spec, reason: str, t0: float):
    """Boot a sandboxed worker; checkpoint, restore and publish it when this start holds the
    key's publish lease, else serve it as booted (another server is publishing)."""
    local.path_under_way(cfg, sandboxed=True)
    lease, why = _publish_lease(cfg, store, key)
    work = _work_dir(cfg)
    phases: dict[str, float] = {}
    try:
        if lease is None:
            client = _boot(cfg, spec, work, phases)
            return _finish(client, "cold", f"{reason}; booted in gVisor ({why})", phases, t0)
        return _boot_checkpoint_publish(cfg, store, key, fields, spec, reason, t0, work, phases)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    finally:
        if lease is not None:
            _quietly(lambda: _bounded(cfg, "lease release", lease.release))


def _publish_lease(cfg: LaunchConfig, store, key: str):
    """(the lease, "") or (None, why this start does not publish)."""
    if not cfg.publish:
        return None, "publishing off"
    name = f"publish-{process_image.manifest_key(key)}"
    try:
        lease = _bounded(cfg, "publish lease", lambda: try_lease(store, name))
        if lease is None:
            who = _bounded(cfg, "publish lease", lambda: holder(store, name))
            return None, f"{who} is publishing the image"
    except Exception as e:  # noqa: BLE001 - a read-only or broken store: serve, do not publish
        return None, f"no publish lease: {e}"
    return lease, ""


def _boot(cfg, spec, work: Path, phases: dict) -> RemoteLLM:
    """Run a worker and serve it as it booted (no checkpoint)."""
    sandbox, proc, channel = _run_worker(cfg, spec, work, phases)
    try:
        channel.send({"t": "start", "seed": cfg.seed})
        return _start(cfg, sandbox, proc, channel, work, None, phases)
    except BaseException:
        sandbox.delete()
        raise


def _run_worker(cfg, spec, work: Path, phases: dict):
    """(sandbox, process, channel) of a fresh sandboxed worker that has said ``booted``."""
    from warmboot.launcher.sandbox import Sandbox

    sandbox = Sandbox(spec, work / "boot")
    try:
        with _phase(phases, "sandboxed_boot"):
            proc = sandbox.run()
            channel = Channel(proc.stdin, proc.stdout, "sandboxed worker")
            channel.expect("booted", cfg.boot_timeout)
    except BaseException:
        sandbox.delete()
        raise
    return sandbox, proc, channel


def _boot_checkpoint_publish(cfg, store, key, fields, spec, reason, t0, work, phases):
    sandbox, _, channel = _run_worker(cfg, spec, work, phases)
    try:
        with progress.phase("prepare_checkpoint"):
            channel.send({"t": "prepare_checkpoint"})
            quiescent = channel.expect("quiescent", 120, total=QUIESCENT_TOTAL_S)
        image = work / "image"
        with _phase(phases, "checkpoint"):
            sandbox.checkpoint(image)
    finally:
        sandbox.delete()
    with _phase(phases, "unpack_image"):
        runsc_image.unpack_or_keep(image / "checkpoint.img")
    canary = quiescent["canary"]
    client = _restore_and_start(cfg, spec, work, image, canary, phases)
    size, mapped = process_image.image_bytes(image), quiescent.get("mapped_chunks") or {}
    meta = {"fields": fields, "canary": canary, "image_bytes": size, "mapped_chunks": mapped}
    try:  # NOTE: the restored, checked worker serves whatever happens to the publish
        with _phase(phases, "publish_image", meta["image_bytes"]) as advance:
            new = run_with_deadline(
                "process image publish",
                lambda p: process_image.publish(store, key, image, meta, p),
                _store_timeout(cfg),
                progress=advance,
            )
    except Exception as e:  # noqa: BLE001 - a full, read-only or stalled store
        log.warning("publishing process snapshot %s failed: %s", key[:12], e)
        why = f"{reason}; booted in gVisor; publish failed: {e}"
        return _finish(client, "cold", why, phases, t0)
    log.info("published process snapshot %s (%.0f MB new)", key[:12], new / 1e6)
    return _finish(client, "cold", f"{reason}; booted in gVisor and published", phases, t0)


def _restore_and_start(
    cfg, spec, work: Path, image: Path, canary: list, phases: dict, verify=None, prefetch=None
):
    """``runsc restore`` the image, send the fresh settings, check the canary. While runsc
    restores, ``verify()`` (the image's chunks) and ``prefetch()`` run and the tokenizer
    loads (none delays runsc's start); the worker is told to start once ``verify`` passed.
    The restore is done when the worker first speaks (``runsc state`` is not polled: each
    call costs 13 ms of CPU while runsc restores)."""
    from warmboot.launcher.sandbox import Sandbox
    from warmboot.tokenizer import Tokenizer

    sandbox = Sandbox(spec, work / "serve")
    try:
        with _phase(phases, "runsc_restore"):
            proc = sandbox.restore(image)
            local.path_under_way(cfg, sandboxed=True)
            verified = _on_thread(verify or (lambda: None))
            if prefetch is not None:
                prefetch()
            tokenizer = Tokenizer.from_dir(cfg.engine["model"])
            verified.result()
            channel = Channel(proc.stdin, proc.stdout, "restored worker")
            channel.send({"t": "start", "seed": cfg.seed})
            if not channel.spoke.wait(cfg.restore_timeout):
                raise WorkerError(f"restore not running after {cfg.restore_timeout:g} s")
        return _start(cfg, sandbox, proc, channel, work, canary, phases, tokenizer)
    except BaseException as e:
        why = sandbox.exited() if isinstance(e, WorkerError) else ""
        sandbox.delete()
        if why:
            raise WorkerError(f"{e}; {why}") from e
        raise


def _start(
    cfg, sandbox, proc, channel, work: Path, canary: list | None, phases: dict, tokenizer=None
):
    """Wait for the worker's ``started`` (its ``start`` frame sent), check the canary against
    ``canary`` (None: nothing to check against, a fresh boot), and wrap the worker in a
    client that reaps it on exit."""
    from warmboot.tokenizer import Tokenizer

    with _phase(phases, "start_and_canary"):
        started = channel.expect("started", cfg.restore_timeout)
    phases["canary"] = started["canary_s"]
    why = None if canary is None else canary_mismatch(canary, started["canary"])
    if why is not None:
        raise WorkerError(f"canary mismatch: {why}")
    tokenizer = tokenizer or Tokenizer.from_dir(cfg.engine["model"])
    client = RemoteLLM(channel, tokenizer, started, LaunchInfo("pending", ""))
    client.on_exit(lambda: _reap(sandbox, proc, work))
    return client


def _verify(cfg: LaunchConfig, linked: list, phases: dict) -> None:
    """Check the image files linked from the store (beside ``runsc restore``, which reads
    them too: one read from disk) under the store deadline."""
    t = time.monotonic()
    step = functools.partial(process_image.verify, linked)
    run_with_deadline("process image verify", step, _store_timeout(cfg))
    phases["verify_image"] = time.monotonic() - t


def _on_thread(fn) -> Future:
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            future.set_exception(e)

    threading.Thread(target=run, name="beside-restore", daemon=True).start()
    return future


@contextmanager
def _phase(phases: dict, name: str, total: int | None = None) -> Iterator[progress.Advance]:
    """A start-up phase (``progress.phase``) timed into ``phases`` when it succeeds."""
    t = time.monotonic()
    with progress.phase(name, total) as advance:
        yield advance
    phases[name] = time.monotonic() - t


def _store_timeout(cfg: LaunchConfig) -> float:
    return float(cfg.engine.get("snapshot_timeout") or ENGINE_DEFAULTS["snapshot_timeout"])


def _discard(cfg: LaunchConfig, store, key: str) -> None:
    try:
        _bounded(cfg, "process image discard", lambda: process_image.discard(store, key))
    except Exception as e:  # noqa: BLE001 - a read-only or full store: boot cold regardless
        log.warning("could not discard process snapshot %s: %s", key[:12], e)


def _bounded(cfg: LaunchConfig, what: str, fn):
    """``fn()`` under the store deadline (a step without progress reports)."""
    return run_with_deadline(what, lambda progress: fn(), _store_timeout(cfg))


def _quietly(fn) -> None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - best effort
        log.warning("%s failed: %s", getattr(fn, "__qualname__", fn), e)


def _finish(client: RemoteLLM, path: str, reason: str, phases: dict, t0: float):
    client.start_info = LaunchInfo(path, reason, time.monotonic() - t0, dict(phases))
    times = ", ".join(f"{k} {v:.2f}s" for k, v in phases.items())
    log.info("worker ready via %s (%s): %s", path, reason, times)
    return client


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
    return spec_mod.worker_spec(cfg.engine, Path(cfg.work_dir))


def _work_dir(cfg: LaunchConfig) -> Path:
    """``<work_dir>/<pid>-<id>``: the pid lets a later start sweep what a killed one left."""
    path = Path(cfg.work_dir) / f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    path.mkdir(parents=True, exist_ok=True)
    return path
