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
from collections.abc import AsyncIterator

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
        body = build(*args)
        return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()

    return Response(await asyncio.to_thread(encode), media_type="application/json")


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
