"""An asyncio front for the engine, for servers: the engine loop runs on its own thread.

Requests and aborts reach that thread through an inbox drained between steps, so callers never
wait for a step to finish. ``generate`` validates on the caller's side (a bad request raises
there and never reaches the engine) and yields incremental outputs; a consumer that stops
early (client gone, task cancelled) aborts its request.

``shutdown`` stops the engine thread (and, with ``owns_engine``, closes the engine); a front
never shut down is shut down at interpreter exit, before the engines are closed, so the
thread is not stepping when the interpreter finalizes.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import threading
import weakref
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from warmboot.core.errors import EngineDeadError, InvalidRequestError
from warmboot.engine.client import RequestStream, put_from_thread
from warmboot.engine.inbox import Inbox
from warmboot.engine.llm_engine import LLMEngine, Prompt
from warmboot.lora_request import LoRARequest
from warmboot.outputs import RequestOutput
from warmboot.sampling_params import SamplingParams

log = logging.getLogger("warmboot")
T = TypeVar("T")


class AsyncLLM:
    def __init__(self, engine: LLMEngine, owns_engine: bool = False):
        """``owns_engine``: ``shutdown`` closes the engine too (its weights and KV pool)."""
        self.engine = engine
        self._owns_engine = owns_engine
        self._inbox = Inbox()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._error: BaseException | None = None
        self.start_info_override = None
        self._thread = threading.Thread(target=self._run, name="warmboot-engine", daemon=True)
        self._thread.start()
        _LIVE.add(self)

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the outputs, shaped by ``params.output_kind``, until finished."""
        stream = await self.add_request(prompt, params, request_id, lora_request=lora_request)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    async def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        group: str | None = None,
        client: str = "",
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Validate (off the event loop) and queue a request; raise ``InvalidRequestError`` if
        bad. Iterate the returned stream for outputs; leaving it early aborts the request.
        ``group``: the API call it belongs to, ``client``: who sent it (the scheduler takes
        clients in turn, then their calls); ``lora_request``: its LoRA adapter, read and
        checked off the event loop and the engine thread before it is queued."""
        if self._error is not None:
            raise EngineDeadError("the engine loop has stopped") from self._error
        request_id = request_id or f"async-{next(self._ids)}"
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        # NOTE: the grammar compiles on its own pool, awaited without holding a thread: a
        # compile-heavy client never takes the threads that check other requests
        checked = await asyncio.to_thread(self.engine.validator.check, prompt, params)
        checked = await self.engine.validator.compile_async(checked)
        if lora_request is not None:
            await asyncio.to_thread(self.engine.check_lora, lora_request)
        queue_: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), queue_)
        self._inbox.put(("add", request_id, checked, group, client, lora_request))
        return RequestStream(request_id, len(checked.token_ids), queue_, self.abort)

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Read and check an adapter (``InvalidRequestError``). Off the engine thread, as a
        request's adapter is: reading one must not stall the running streams' steps."""
        await asyncio.to_thread(self.engine.check_lora, lora_request)

    async def remove_lora(self, name: str) -> None:
        """Forget adapter ``name`` between two steps (``KeyError`` if unknown); requests
        running with it finish."""

        def remove(engine: LLMEngine) -> None:
            if engine.lora is None:
                raise KeyError(name)
            engine.lora.remove(name)

        await self.call(remove)

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between two steps and return its result."""
        future = asyncio.get_running_loop().create_future()
        self._inbox.put(("call", fn, future))
        return await future

    @property
    def dead(self) -> str | None:
        """Why the engine loop stopped, or None while it runs."""
        return None if self._error is None else f"engine loop failed: {self._error!r}"

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.sched_config.max_model_len

    @property
    def start_info(self):
        """How the engine started (a launcher may override it with its own account)."""
        return self.start_info_override or self.engine.start_info

    async def debug_state(self) -> dict:
        def inspect(engine: LLMEngine) -> dict:
            engine.block_manager.check_invariants()
            return {
                **engine.stats(),
                "unfinished": engine.has_unfinished_requests(),
                "invariants_ok": True,
            }

        return await self.call(inspect)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def shutdown(self) -> None:
        """Stop the engine thread after its current step (idempotent)."""
        _LIVE.discard(self)
        self._inbox.put(("stop",))
        self._thread.join(timeout=10)
        if self._owns_engine and not self._thread.is_alive():
            self.engine.startup.close()

    def stats(self) -> dict:
        return self.engine.stats()

    # -- engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._inbox.serve(self.engine, self._apply, self._deliver_step)
        except BaseException as e:  # noqa: BLE001 - every waiting caller must hear about it
            log.exception("engine loop failed")
            self._error = e
            for request_id in list(self._streams):
                self._deliver(request_id, EngineDeadError(f"engine loop failed: {e!r}"))

    def _apply(self, cmd: tuple) -> bool:
        """One inbox command on the engine thread; False means stop."""
        if cmd[0] == "stop":
            return False
        if cmd[0] == "add":
            _, request_id, checked, group, client, lora = cmd
            try:
                self.engine.add_request(
                    request_id, checked, group=group, client=client, lora_request=lora
                )
            except ValueError as e:
                self._deliver(request_id, e)
        elif cmd[0] == "abort":
            self.engine.abort_request(cmd[1])
            self._streams.pop(cmd[1], None)
        elif cmd[0] == "call":
            self._run_call(cmd[1], cmd[2])
        return True

    def _run_call(self, fn: Callable, future: asyncio.Future) -> None:
        try:
            result, error = fn(self.engine), None
        except Exception as e:  # noqa: BLE001 - handed to the caller
            result, error = None, e

        def settle() -> None:
            if future.cancelled():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        try:
            future.get_loop().call_soon_threadsafe(settle)
        except RuntimeError:  # the caller's loop is closed
            pass

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """One step's outputs: one wake-up per event loop, not one per output."""
        items = []
        for out in outputs:
            entry = self._streams.get(out.request_id)
            if entry is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            items.append((*entry, out))
        put_from_thread(items)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        entry = self._streams.get(request_id)
        if entry is None:
            return
        if isinstance(item, BaseException) or item.finished:
            del self._streams[request_id]
        loop, stream = entry
        try:
            loop.call_soon_threadsafe(stream.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening
            pass


_LIVE: weakref.WeakSet[AsyncLLM] = weakref.WeakSet()


@atexit.register
def _shutdown_all() -> None:
    """Registered after ``engine.shutdown``'s hook, so it runs before it (atexit is LIFO)."""
    for front in list(_LIVE):
        try:
            front.shutdown()
        except Exception:  # noqa: BLE001 - exiting anyway
            log.debug("stopping an engine thread at exit failed", exc_info=True)
