"""The launcher's side of a worker: a frame channel, and ``RemoteLLM``, the ``EngineClient``
the HTTP server uses when the engine lives in a worker process. Torch-free."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import BinaryIO

from warmboot.core.errors import EngineDeadError, InvalidRequestError
from warmboot.engine import progress
from warmboot.engine.client import RequestStream, put_from_thread
from warmboot.launcher.frames import FrameWriter, OutputAccumulator, params_to_wire, read_frame
from warmboot.lora_request import LoRARequest
from warmboot.sampling_params import SamplingParams
from warmboot.tokenizer import Tokenizer

log = logging.getLogger("warmboot")


class WorkerError(RuntimeError):
    """The worker died, said ``fatal``, or did not answer in time."""


class WorkerSettingsError(WorkerError, ValueError):
    """The worker's engine refused its settings or model (a user error, not a crash)."""


class Channel:
    """Frames to a worker's stdin; frames from its stdout land in a queue (reader thread)."""

    def __init__(self, stdin: BinaryIO, stdout: BinaryIO, name: str = "worker"):
        self.name = name
        self._writer = FrameWriter(stdin)
        self._stdin = stdin
        self.frames: queue.Queue = queue.Queue()
        self.spoke = threading.Event()
        """Set once the first frame (or the end of the stream) has come."""
        self._thread = threading.Thread(target=self._read, args=(stdout,), daemon=True)
        self._thread.start()

    def _read(self, stdout: BinaryIO) -> None:
        try:
            while (frame := read_frame(stdout)) is not None:
                self.frames.put(frame)
                self.spoke.set()
        except Exception as e:  # noqa: BLE001 - the consumer hears about it as EOF
            log.warning("%s: bad frame stream: %s", self.name, e)
        self.frames.put(None)
        self.spoke.set()

    def send(self, frame: dict) -> None:
        try:
            self._writer.send(frame)
        except (BrokenPipeError, ValueError, OSError) as e:
            raise WorkerError(f"{self.name} is gone: {e}") from None

    def expect(self, kind: str, timeout: float, total: float | None = None) -> dict:
        """The next frame, which must be ``kind`` (``stats`` frames are skipped; ``phase``
        frames are replayed as start-up phases on this thread). ``timeout`` bounds the wait
        for any frame (a skipped one restarts it), ``total`` the whole wait."""
        end = None if total is None else time.monotonic() + total
        while True:
            wait = timeout if end is None else max(0.0, min(timeout, end - time.monotonic()))
            try:
                frame = self.frames.get(timeout=wait)
            except queue.Empty:
                within = timeout if wait == timeout else total
                raise WorkerError(f"{self.name} sent no {kind!r} within {within:.0f}s") from None
            if frame is None:
                raise WorkerError(f"{self.name} exited before sending {kind!r}")
            if frame["t"] == "fatal" and frame.get("user_error"):
                raise WorkerSettingsError(frame.get("error") or frame["message"])
            if frame["t"] == "fatal":
                raise WorkerError(f"{self.name} failed: {frame['message']}")
            if frame["t"] == "stats":
                continue
            if frame["t"] == "phase":
                progress.relay(frame, "worker")
                continue
            if frame["t"] != kind:
                raise WorkerError(f"{self.name} sent {frame['t']!r}, expected {kind!r}")
            return frame

    def close(self) -> None:
        try:
            self._stdin.close()
        except OSError:
            pass


@dataclass(frozen=True)
class LaunchInfo:
    """How this replica started: ``path`` is cold, restored_image or restored_process."""

    path: str
    reason: str
    ready_s: float = 0.0
    phase_times: dict[str, float] = field(default_factory=dict)
    fallbacks: tuple[str, ...] = ()
    """Why tier P was not used (runsc_unavailable, gpu_host, restore_failed, canary_mismatch,
    sandboxed_boot_failed), each counted in ``/metrics``."""


class RemoteLLM:
    """``EngineClient`` over a started worker's channel (after its ``started`` frame)."""

    def __init__(
        self,
        channel: Channel,
        tokenizer: Tokenizer,
        started: dict,
        info: LaunchInfo,
        gone: Callable[[], str] | None = None,
    ):
        """``gone()``: why the worker's output ended (its exit status), when it ends without
        a ``fatal`` frame."""
        self.channel = channel
        self._gone = gone
        self.tokenizer = tokenizer
        self.max_model_len = int(started["max_model_len"])
        self.start_info = info
        self._stats = dict(started["stats"])
        self._pending: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._acc: dict[str, OutputAccumulator] = {}
        self._dead: str | None = None
        self._on_exit: list = []
        threading.Thread(target=self._dispatch, name="warmboot-remote", daemon=True).start()

    # -- EngineClient --------------------------------------------------------------------------
    async def add_request(
        self,
        prompt,
        params: SamplingParams,
        request_id: str | None = None,
        group: str | None = None,
        client: str = "",
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """``lora_request`` crosses as a plain map (the worker reads and checks its adapter
        off its engine thread before queueing)."""
        if self._dead is not None:
            raise EngineDeadError(f"the worker is gone: {self._dead}")
        rid = request_id or f"remote-{uuid.uuid4().hex}"
        loop = asyncio.get_running_loop()
        reply, outputs = loop.create_future(), asyncio.Queue()
        self._pending[rid] = (loop, reply)
        self._streams[rid] = (loop, outputs)
        frame = {"t": "add", "id": rid, "prompt": prompt, "params": params_to_wire(params)}
        lora = None if lora_request is None else asdict(lora_request)
        self.channel.send(frame | {"group": group, "client": client, "lora": lora})
        try:
            added = await reply
        except BaseException:
            self._streams.pop(rid, None)
            self.abort(rid)
            raise
        return RequestStream(rid, len(added["prompt_token_ids"]), outputs, self.abort)

    async def debug_state(self) -> dict:
        return (await self._ask({"t": "debug"}))["state"]

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Have the worker read and check an adapter (``InvalidRequestError``)."""
        reply = await self._ask({"t": "add_lora", "lora": asdict(lora_request)})
        if reply.get("error") is not None:
            raise InvalidRequestError(reply["error"])

    async def remove_lora(self, name: str) -> None:
        """Have the worker's engine forget adapter ``name`` (``KeyError`` if unknown)."""
        reply = await self._ask({"t": "remove_lora", "name": name})
        if reply.get("error") is not None:
            raise KeyError(name)

    async def _ask(self, frame: dict) -> dict:
        """Send ``frame`` with a fresh id; its reply frame (same id)."""
        if self._dead is not None:
            raise EngineDeadError(f"the worker is gone: {self._dead}")
        rid = f"{frame['t']}-{uuid.uuid4().hex}"
        future = asyncio.get_running_loop().create_future()
        self._pending[rid] = (asyncio.get_running_loop(), future)
        try:
            self.channel.send(frame | {"id": rid})
            return await future
        finally:
            self._pending.pop(rid, None)

    def stats(self) -> dict:
        """The worker's stats, with this start's phases: the launcher's (fetch, restore,
        canary...) plus, when the worker booted now, its engine's as ``worker.<phase>``. A
        restored process's own engine phases are the image's first boot, not this start's."""
        out = dict(self._stats)
        phases = dict(self.start_info.phase_times)
        if self.start_info.path != "restored_process":
            worker = self._stats.get("startup_times", {})
            phases |= {f"worker.{k}": v for k, v in worker.items()}
        out["startup_times"] = phases
        return out

    @property
    def dead(self) -> str | None:
        """Why the worker is gone, or None while it serves."""
        return self._dead

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._acc.pop(request_id, None)
        if self._dead is None:
            try:
                self.channel.send({"t": "abort", "id": request_id})
            except WorkerError:
                pass

    def shutdown(self) -> None:
        try:
            self.channel.send({"t": "stop"})
        except WorkerError:
            pass
        self.channel.close()
        for fn in self._on_exit:
            fn()

    def on_exit(self, fn) -> None:
        """Run ``fn`` at shutdown (the launcher reaps the worker and its sandbox)."""
        self._on_exit.append(fn)

    # -- dispatcher thread ---------------------------------------------------------------------
    def _dispatch(self) -> None:
        while (frame := self.channel.frames.get()) is not None:
            kind = frame["t"]
            if kind == "outs":
                self._deliver_outputs(frame["items"])
            elif kind == "added":
                self._acc[frame["id"]] = OutputAccumulator(
                    frame["id"], frame["prompt"], frame["prompt_token_ids"], frame["output_kind"]
                )
                self._settle(frame["id"], frame)
            elif kind == "rejected":
                self._streams.pop(frame["id"], None)
                self._settle(frame["id"], InvalidRequestError(frame["message"]))
            elif kind in ("debug", "lora"):
                self._settle(frame["id"], frame)
            elif kind == "stats":
                self._stats = frame["stats"]
            elif kind == "phase":  # NOTE: an idle-engine operation of the worker's main thread
                progress.relay(frame, "worker")
            elif kind == "fatal":
                log.error("worker failed: %s", frame["message"])
                self._dead = frame["message"]
            else:
                log.warning("worker said %s", frame)
        self._fail_all(self._dead or self._why_gone())

    def _why_gone(self) -> str:
        if self._gone is None:
            return "the worker exited"
        try:
            return self._gone()
        except Exception as e:  # noqa: BLE001 - the plain reason will do
            return f"the worker exited ({e})"

    def _deliver_outputs(self, items: list[dict]) -> None:
        """One step's outputs: one wake-up per event loop, not one per output."""
        ready = []
        for item in items:
            rid = item["id"]
            acc, entry = self._acc.get(rid), self._streams.get(rid)
            if acc is None or entry is None:
                continue  # aborted on our side: drop late outputs
            out = acc.add(item)
            if out.finished:
                self._acc.pop(rid, None)
                self._streams.pop(rid, None)
            ready.append((*entry, out))
        put_from_thread(ready)

    def _settle(self, rid: str, value) -> None:
        entry = self._pending.pop(rid, None)
        if entry is None:
            return
        loop, future = entry

        def settle() -> None:
            if future.done():
                return
            if isinstance(value, BaseException):
                future.set_exception(value)
            else:
                future.set_result(value)

        _call(loop, settle)

    def _fail_all(self, reason: str) -> None:
        self._dead = reason
        error = EngineDeadError(f"the worker is gone: {reason}")
        for rid in list(self._pending):
            self._settle(rid, error)
        for loop, q in list(self._streams.values()):
            _call(loop, q.put_nowait, error)
        self._streams.clear()


def _call(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # that event loop is closed: nobody is listening
        pass
