"""The worker process: holds the engine and serves frames on stdin/stdout.

    python -m warmboot.launcher.worker '{"model": DIR, ...LLM kwargs}'
    python -m warmboot.launcher.worker   (a spare: the settings come as a ``boot`` frame)

Life: boot the engine -> ``booted`` -> (``prepare_checkpoint`` -> shrink the KV pool ->
``quiescent``, and the launcher checkpoints the process here) -> ``start`` with the
settings that must be fresh after a restore (seed, KV size) -> canary -> ``started`` ->
requests until ``stop`` or end of stdin. Frames are written to the original fd 1; Python's
``sys.stdout`` is pointed at stderr so a stray print cannot corrupt the stream. Start-up
phases on the main thread go out as ``phase`` frames (the launcher logs them and names them
in ``/health``); the worker's own log goes to stderr (a log file in the sandbox).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from warmboot.core.errors import InvalidRequestError
from warmboot.engine import progress
from warmboot.engine.inbox import Inbox
from warmboot.launcher.engine_process import LOG_LEVEL_ENV, follow_parent
from warmboot.launcher.frames import (
    FrameWriter,
    output_to_wire,
    params_from_wire,
    read_frame,
)
from warmboot.lora_request import LoRARequest

log = logging.getLogger("warmboot.worker")
STATS_INTERVAL_S = 0.5
CHECKPOINT_KV_BLOCKS = 1
HEARTBEAT_S = 10.0
"""While a background compile runs before a checkpoint, a stats frame this often: the
launcher waits for ``quiescent`` while frames come (a compile in gVisor takes minutes)."""


class Worker:
    def __init__(self, engine, writer: FrameWriter):
        self.engine = engine
        self.writer = writer
        self.inbox = Inbox()
        self._compiling: dict[str, tuple] = {}
        """Requests whose grammar is compiling: id -> (frame, params, checked, ticket)."""
        self._lora_checks = ThreadPoolExecutor(1, thread_name_prefix="warmboot-lora")
        """Reads and checks LoRA adapters off the engine thread (no thread until used)."""
        self._checking: set[str] = set()
        """Requests whose adapter is being read (engine thread only)."""
        self.full_kv_blocks = engine.facts.num_kv_blocks
        self._last_stats = 0.0
        self._sent_stats: dict | None = None

    def reader(self, stdin) -> None:
        """Thread: frames from stdin into the inbox; end of stdin means stop."""
        try:
            while (frame := read_frame(stdin)) is not None:
                self.inbox.put(frame)
        except Exception as e:  # noqa: BLE001 - a broken pipe ends the worker cleanly
            log.error("stdin: %s", e)
        self.inbox.put({"t": "stop"})

    def run(self) -> None:
        self.inbox.serve(self.engine, self._apply, self._deliver, idle_tick=STATS_INTERVAL_S)

    def _apply(self, frame: dict) -> bool:
        if frame["t"] == "stop":
            return False
        getattr(self, f"_on_{frame['t']}", self._on_unknown)(frame)
        return True

    def _deliver(self, outs: list) -> None:
        if outs:  # one frame a step: under gVisor each write is a costly syscall
            items = [{"id": o.request_id, **output_to_wire(o)} for o in outs]
            self.writer.send({"t": "outs", "items": items})
        self._send_stats(force=not self.engine.has_unfinished_requests())

    # -- commands ------------------------------------------------------------------------------
    def _on_add(self, f: dict) -> None:
        if f.get("lora") is not None and not self._lora_ready(f):
            return
        try:
            params = params_from_wire(f["params"])
            checked = self.engine.validator.check(f["prompt"], _wired(params))
            if checked.needs_grammar:  # NOTE: compiled on the grammar pool, not this thread
                ticket = self.engine.grammars.compiles.submit(checked.grammar_key)
                self._compiling[f["id"]] = (f, params, checked, ticket)
                done = {"t": "compiled", "id": f["id"]}
                ticket.add_done_callback(lambda _: self.inbox.put(done))
                return
        except (InvalidRequestError, ValueError, TypeError) as e:
            self._reject(f, e)
            return
        self._queue(f, params, checked)

    def _lora_ready(self, f: dict) -> bool:
        """Whether the request's adapter has been read and checked (off this thread: its
        frame comes back with ``lora_checked``); a bad one is rejected here."""
        if "lora_checked" not in f:
            self._checking.add(f["id"])
            self._lora_checks.submit(self._check_lora, f)
            return False
        if f["id"] not in self._checking:  # NOTE: aborted meanwhile
            return False
        self._checking.discard(f["id"])
        if f["lora_checked"] is not True:
            self._reject(f, InvalidRequestError(f["lora_checked"]))
            return False
        return True

    def _check_lora(self, f: dict) -> None:
        """Pool thread: read and check the request's adapter, then hand it back."""
        error = self._lora_error(f["lora"])
        self.inbox.put({**f, "lora_checked": True if error is None else error})

    def _lora_error(self, lora: dict) -> str | None:
        """Why the adapter cannot be served (read and checked now), or None."""
        try:
            self.engine.check_lora(LoRARequest(**lora))
        except (InvalidRequestError, ValueError, TypeError) as e:
            return str(e)
        except Exception as e:  # noqa: BLE001 - on the pool thread: the caller must hear
            log.exception("reading a LoRA adapter failed")
            return f"{type(e).__name__}: {e}"
        return None

    def _on_add_lora(self, f: dict) -> None:
        def check() -> None:
            error = self._lora_error(f["lora"])
            self.writer.send({"t": "lora", "id": f["id"], "error": error})

        self._lora_checks.submit(check)

    def _on_remove_lora(self, f: dict) -> None:
        error = None
        try:
            if self.engine.lora is None:
                raise KeyError(f["name"])
            self.engine.lora.remove(f["name"])
        except KeyError:
            error = f"no adapter {f['name']!r}"
        self.writer.send({"t": "lora", "id": f["id"], "error": error})

    def _on_compiled(self, f: dict) -> None:
        entry = self._compiling.pop(f["id"], None)
        if entry is None or entry[3].cancelled():  # aborted meanwhile
            return
        frame, params, checked, ticket = entry
        try:
            checked = replace(checked, grammar=ticket.result())
        except InvalidRequestError as e:
            self._reject(frame, e)
            return
        self._queue(frame, params, checked)

    def _queue(self, f: dict, params, checked) -> None:
        try:
            lora = f.get("lora")
            self.engine.add_request(
                f["id"],
                checked,
                group=f.get("group"),
                client=f.get("client", ""),
                lora_request=None if lora is None else LoRARequest(**lora),
            )
        except (InvalidRequestError, ValueError, TypeError) as e:
            self._reject(f, e)
            return
        added = {"t": "added", "id": f["id"], "prompt": checked.text}
        added["prompt_token_ids"] = checked.token_ids
        self.writer.send({**added, "output_kind": params.output_kind})

    def _reject(self, f: dict, error: Exception) -> None:
        self.writer.send({"t": "rejected", "id": f["id"], "message": str(error)})

    def _on_abort(self, f: dict) -> None:
        self._checking.discard(f["id"])
        entry = self._compiling.pop(f["id"], None)
        if entry is not None:
            entry[3].cancel()  # NOTE: a queued compile nobody waits for never runs
        self.engine.abort_request(f["id"])

    def _on_debug(self, f: dict) -> None:
        self.engine.block_manager.check_invariants()
        state = {
            **self.engine.stats(),
            "unfinished": self.engine.has_unfinished_requests(),
            "invariants_ok": True,
        }
        self.writer.send({"t": "debug", "id": f["id"], "state": state})

    def _on_prepare_checkpoint(self, f: dict) -> None:
        """Idle only: shrink the KV pool and free what can be freed, then say so."""
        if self.engine.has_unfinished_requests():
            self.writer.send({"t": "error", "message": "cannot checkpoint a busy worker"})
            return
        while not self.engine.wait_compiled(HEARTBEAT_S):  # NOTE: never checkpoint a compile
            self.writer.send({"t": "stats", "stats": self.engine.stats()})  # in flight; alive
        mapped = self.engine.remap_weights_from_snapshot()  # NOTE: a tier-A restore copies them
        if mapped:
            log.info("weights now mapped from the tier-A snapshot (kept out of the image)")
        canary = self._canary()
        self.engine.resize_kv_cache(CHECKPOINT_KV_BLOCKS)
        compiled = self.engine.runner.compiled
        if compiled is not None and mapped:  # NOTE: kept in the store, mapped like the weights;
            # listed first: the launcher reads them ahead first (a decode step reads only them)
            from warmboot.snapshot.stash import keeper

            keep, kept = keeper(self.engine.startup.snapshot.store)
            compiled.linears.stash(keep)
            mapped = kept | mapped
        elif compiled is not None:  # NOTE: packed again from the weights after a restore
            log.info("packed weights released: %d bytes", compiled.linears.release())
        gc.collect()
        _trim_heap()
        self.writer.send({"t": "quiescent", "canary": canary, "mapped_chunks": mapped})

    def _on_start(self, f: dict) -> None:
        """Settings that must be fresh (after a restore too), then the canary (unless the
        launcher has nothing to check it against: ``"canary": False``)."""
        import torch

        if self.engine.facts.num_kv_blocks != self.full_kv_blocks:
            with progress.phase("allocate_kv"):
                self.engine.resize_kv_cache(self.full_kv_blocks)
        if self.engine.runner.compiled is not None:
            with progress.phase("repack_weights"):
                self.engine.runner.compiled.linears.repack()
        torch.manual_seed(int(f.get("seed", 0)))
        t0, canary = time.perf_counter(), []
        if f.get("canary", True):
            with progress.phase("canary"):
                canary = self._canary()
        self.writer.send(
            {
                "t": "started",
                "canary": canary,
                "canary_s": time.perf_counter() - t0,
                "max_model_len": self.engine.sched_config.max_model_len,
                "start_path": self.engine.start_info.path,
                "start_reason": self.engine.start_info.reason,
                "startup_times": dict(self.engine.startup_times),
                "stats": self.engine.stats(),
            }
        )

    def _canary(self) -> list[list]:
        """Greedy tokens (and logprobs) of the engine's fixed warm-up prompt."""
        return [[int(t), float(lp)] for t, lp in self.engine.run_canary()]

    def _on_unknown(self, f: dict) -> None:
        self.writer.send({"t": "error", "message": f"unknown frame type {f['t']!r}"})

    def _send_stats(self, force: bool) -> None:
        """Every ``STATS_INTERVAL_S`` while busy; when idle (``force``), when they changed."""
        now = time.monotonic()
        if force or now - self._last_stats >= STATS_INTERVAL_S:
            self._last_stats = now
            stats = self.engine.stats()
            if force and stats == self._sent_stats:
                return
            self._sent_stats = stats
            self.writer.send({"t": "stats", "stats": stats})


def _wired(params):
    """Only deltas cross the pipe (the launcher folds them back): a cumulative request runs
    as a delta one here, so the worker never copies a whole output per step."""
    if params.output_kind != "cumulative":
        return params
    return replace(params, output_kind="delta")


def _user_error(e: Exception) -> bool:
    """Bad settings or model files (what ``EngineHolder`` reports without a traceback)."""
    from warmboot.architectures import UnsupportedModelError
    from warmboot.config import ModelFilesError

    return isinstance(e, (UnsupportedModelError, ModelFilesError, ValueError))


def _trim_heap() -> None:
    """Give freed heap pages back to the OS so they are not in the process image."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    gc.disable()  # NOTE: until torch and the engine are imported (``_freeze_imports``)
    follow_parent()
    argv = sys.argv[1:] if argv is None else argv
    frames_out = sys.stdout.buffer
    # NOTE: unbuffered: a daemon thread blocked inside sys.stdin's buffered reader holds its
    # lock, and the interpreter's teardown, which flushes sys.stdin, aborts on it
    stdin = open(sys.stdin.fileno(), "rb", buffering=0, closefd=False)  # noqa: SIM115
    sys.stdout = sys.stderr  # NOTE: fd 1 carries frames only
    level = os.environ.pop(LOG_LEVEL_ENV, "INFO")  # NOTE: an engine process logs less
    logging.basicConfig(level=level, format="worker: %(message)s", stream=sys.stderr)
    writer = FrameWriter(frames_out)
    with progress.listen(lambda event: writer.send(progress.as_frame(event))):
        return _serve(argv, writer, stdin)


def _serve(argv: list[str], writer: FrameWriter, stdin) -> int:
    t0 = time.perf_counter()
    try:
        from warmboot import LLM

        _freeze_imports()
        settings = json.loads(argv[0]) if argv else _boot_frame(stdin)
        if settings is None:
            return 0
        engine = LLM(**settings).engine
    except Exception as e:  # noqa: BLE001 - reported to the launcher, which falls back
        writer.send(
            {
                "t": "fatal",
                "message": f"{type(e).__name__}: {e}",
                "error": str(e),
                "user_error": _user_error(e),
            }
        )
        return 1
    # NOTE: no full-collection stalls over the booted engine (see EngineHolder); the young
    # generations only are collected first: a full collection here took 70 ms of the demo's
    # start (200k objects) to free ~230 objects, exception frames holding 70 KB
    gc.collect(1)
    gc.freeze()
    worker = Worker(engine, writer)
    writer.send({"t": "booted", "boot_s": time.perf_counter() - t0})
    threading.Thread(target=worker.reader, args=(stdin,), daemon=True).start()
    code = _run(worker, writer)
    if not engine.startup.wait_compiled(0):
        # NOTE: a background compile still under way (tens of seconds) is abandoned: the
        # interpreter's teardown would wait for its thread (and the launcher kills a worker
        # that has not stopped within 10 s), or abort around a thread inside torch's C++.
        # os._exit skips that teardown. (A publishing boot compiles in the foreground.)
        log.info("stopping with the background compile under way: abandoned")
        logging.shutdown()
        os._exit(code)
    engine.startup.close()
    return code


def _freeze_imports() -> None:
    """Move what the imports made (~185k objects, torch's and the engine's modules) to the
    collector's permanent generation and resume collecting. Collected as they were made, the
    imports ran three full collections (0.08-0.11 s of a demo start) and each collection of
    the boot traversed them again (0.06 s); their garbage (~7k objects, under 1 MB) stays."""
    gc.freeze()
    gc.enable()


def _run(worker: Worker, writer: FrameWriter) -> int:
    try:
        worker.run()
    except Exception as e:  # noqa: BLE001
        log.exception("worker failed")
        writer.send({"t": "fatal", "message": f"{type(e).__name__}: {e}"})
        return 1
    return 0


def _boot_frame(stdin) -> dict | None:
    """A spare engine process (``engine_process.prestart``: started without settings, it
    imports torch and the engine meanwhile) gets them in its first frame; None: not needed."""
    frame = read_frame(stdin)
    if frame is None:
        return None
    if frame.get("t") != "boot" or not isinstance(frame.get("engine"), dict):
        raise ValueError(f"a spare engine process expects a boot frame, got {frame.get('t')!r}")
    return frame["engine"]


if __name__ == "__main__":
    sys.exit(main())
