"""Getting a handler's result to the client: a stream of chunks as server-sent events
(``sse``, which ends an errored stream with an error event and always sends ``[DONE]``), and
a non-streaming result raced against the client's disconnect (``until_disconnect``, which
cancels the work, and so aborts its requests, when the client goes away first), and a
finished result's body encoded off the event loop (``json_body``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Iterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from warmboot.core.errors import EngineDeadError, InvalidRequestError
from warmboot.server.errors import ApiError
from warmboot.server.fields import error_body

log = logging.getLogger("warmboot")


async def json_body(build, *args) -> Response:
    """``build(*args)``, a dict, as a JSON response, built and encoded on a worker thread: a
    large body (16 echoed choices with prompt logprobs: megabytes of dicts) would hold the event
    loop for seconds, and pure Python there yields the GIL to it every few ms."""

    def encode() -> bytes:
        return "".join(json_pieces(build(*args))).encode()

    return Response(await asyncio.to_thread(encode), media_type="application/json")


BATCH = 64
"""Elements of a long list encoded by one C call of ``json.dumps``."""


def json_pieces(obj, depth: int = 0, done: dict | None = None) -> Iterator[str]:
    """Compact JSON of ``obj`` in pieces, each from one ``json.dumps`` call over at most
    ``BATCH`` elements of a long list: the C encoder holds the GIL for a whole call (26 MB of
    echoed prompt logprobs: 0.8 s, the event loop and every stream stalled), and between
    pieces the event loop's thread gets it back. Containers are walked to depth 8; lists
    longer than ``BATCH`` are cut into batches, whose elements (a token's logprobs) are small.
    A long list met again (``n`` choices share their prompt's logprobs: 16 x 1.3 MB for the
    echo load) is encoded once: ``done`` maps its id to its JSON while ``obj`` holds it."""
    done = {} if done is None else done
    if depth >= 8 or not isinstance(obj, dict | list | tuple) or not obj:
        yield _dumps(obj)
    elif isinstance(obj, dict):
        for i, (key, value) in enumerate(obj.items()):
            yield ("{" if i == 0 else ",") + _dumps({key: 0})[1:-3] + ":"  # json's key rules
            yield from json_pieces(value, depth + 1, done)
        yield "}"
    elif len(obj) > BATCH:
        yield from _long_list(obj, done)
    else:
        for i, item in enumerate(obj):
            yield "[" if i == 0 else ","
            yield from json_pieces(item, depth + 1, done)
        yield "]"


def _long_list(obj: list | tuple, done: dict) -> Iterator[str]:
    if id(obj) in done:
        yield done[id(obj)]
        return
    pieces = []
    for i in range(0, len(obj), BATCH):
        pieces.append(("[" if i == 0 else ",") + _dumps(list(obj[i : i + BATCH]))[1:-1])
        yield pieces[-1]
    yield "]"
    done[id(obj)] = "".join(pieces) + "]"


def _dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def sse(chunks: AsyncIterator[dict], typed: bool = False, on_close=None) -> StreamingResponse:
    """``typed`` (the Responses API): each chunk's ``type`` as the event name, no ``[DONE]``.
    ``on_close()`` runs once the response has ended, the client gone or not (the stream may
    never have started)."""

    async def events():
        try:
            async for chunk in chunks:
                name = f"event: {chunk['type']}\n" if typed else ""
                yield f"{name}data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        except (EngineDeadError, InvalidRequestError, ValueError) as e:
            error = error_body(
                str(e),
                "server_error" if isinstance(e, EngineDeadError) else "invalid_request_error",
            )
            if typed:  # the Responses API's error event
                yield f"event: error\ndata: {json.dumps({'type': 'error', **error['error']})}\n\n"
            else:
                yield f"data: {json.dumps(error)}\n\n"
        if not typed:
            yield "data: [DONE]\n\n"

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    closed = None if on_close is None else BackgroundTask(on_close)
    return StreamingResponse(
        events(), media_type="text/event-stream", headers=headers, background=closed
    )


async def until_disconnect(request: Request, work):
    """Run ``work``; if the client disconnects first, cancel it (which aborts its requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        log.info("client disconnected; request aborted")
        raise ApiError(499, "client disconnected", "invalid_request_error")
    finally:
        watcher.cancel()
        task.cancel()


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
