"""What the HTTP server needs from an engine, in-process (``AsyncLLM``) or in a worker
process (``warmboot.launcher.remote.RemoteLLM``). Torch-free: the launcher imports it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from warmboot.lora_request import LoRARequest
from warmboot.outputs import RequestOutput
from warmboot.sampling_params import SamplingParams
from warmboot.tokenizer import Tokenizer


class RequestStream:
    """The outputs of one request, as an async iterator; closing it early aborts the request.

    The producer puts ``RequestOutput``s (or an exception) on ``queue`` from any thread via
    the event loop; ``abort`` is called at most once, when the consumer leaves early.
    """

    def __init__(
        self,
        request_id: str,
        num_prompt_tokens: int,
        queue: asyncio.Queue,
        abort: Callable[[str], None],
    ):
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self._queue = queue
        self._abort = abort
        self.finished = False
        self.aborted = False
        """Aborted before its last output (the consumer left or called ``abort``)."""

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:  # cancelled: the consumer is gone
            self.abort()
            raise
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def abort(self) -> None:
        if not self.finished:
            self.finished = self.aborted = True
            self._abort(self.request_id)

    def __del__(self) -> None:
        if not self.finished:  # dropped without being drained
            self._abort(self.request_id)


def put_from_thread(items: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue, Any]]) -> None:
    """From an engine or dispatcher thread, put each item on its stream's queue: one wake-up
    per event loop for the whole batch (each wake-up is a write to that loop's self-pipe)."""
    batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
    for loop, queue, item in items:
        batches.setdefault(loop, []).append((queue, item))
    for loop, batch in batches.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:  # that event loop is closed: nobody is listening
            pass


def _put_all(batch: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in batch:
        queue.put_nowait(item)


class EngineClient(Protocol):
    tokenizer: Tokenizer
    max_model_len: int
    start_info: Any
    """Has ``path`` ("cold", "restored_image", "restored_process") and ``reason``."""
    dead: str | None
    """Why the engine stopped serving for good (the holder then boots a new one), or None."""

    async def add_request(
        self,
        prompt: Any,
        params: SamplingParams,
        request_id: str | None = None,
        group: str | None = None,
        client: str = "",
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Validate and queue; raise ``InvalidRequestError`` naming the problem if bad.
        ``group``: the API call the request belongs to, ``client``: who sent it (the scheduler
        takes clients in turn, then their calls); ``lora_request``: the LoRA adapter it runs
        with (read and checked before it is queued; None: the base model)."""
        ...

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Read and check an adapter into the engine (``InvalidRequestError`` naming what is
        wrong: LoRA off, a bad path or adapter, a name known with another path)."""
        ...

    async def remove_lora(self, name: str) -> None:
        """Forget adapter ``name`` (``KeyError`` if the engine does not know it); requests
        running with it finish."""
        ...

    async def debug_state(self) -> dict:
        """Engine counters after checking the block pool's invariants (on the engine thread)."""
        ...

    def stats(self) -> dict: ...

    def shutdown(self) -> None: ...
