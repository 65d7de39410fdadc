"""The fleet's front door: an OpenAI-compatible ingress on Ray Serve (one light replica, no
torch) in front of the warmboot replicas.

* Every API request is forwarded, streamed, to a replica over a Serve handle (the replicas
  run warmboot's own app, so the fleet speaks every route the single server does).
* The queue is bounded: more than ``max_queued_requests`` waiting for a replica, or one that
  waited ``request_timeout_s``, gets 503 with ``Retry-After`` (Serve's own backpressure
  becomes the same 503).
* A stream a replica cannot finish (drained past its timeout, or killed) ends with an error
  event and ``[DONE]``, never a silent cut.
* ``/health`` and ``/metrics`` answer here, without waking a replica: replica counts by
  state (from the Serve controller), scale-up decisions and how long each took, each
  replica start's path and seconds, and every replica's own metrics (labelled by replica).
"""

# NOTE: no `from __future__ import annotations`: FastAPI reads the routes' annotations at
# class-definition time, and string annotations on a Serve ingress class do not resolve.
import asyncio
import hmac
import json
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from ray import serve
from ray.serve.exceptions import BackPressureError

from warmboot.fleet.config import FleetConfig
from warmboot.fleet.metrics import FleetView, render_metrics

log = logging.getLogger("warmboot")
RETRY_AFTER_S = 2
STATUS_POLL_S = 0.25
app = FastAPI(title="warmboot fleet", docs_url=None, redoc_url=None)


async def _body(stream, sse: bool):
    try:
        async for chunk in stream:
            yield chunk
    except asyncio.CancelledError:
        stream.cancel()  # NOTE: the client went away: the replica aborts the request
        raise
    except Exception as e:  # noqa: BLE001 - the replica went away mid-stream
        log.warning("a replica stream ended early: %s", e)
        if sse:
            why = f"the replica serving this stream went away: {type(e).__name__}"
            error = _error(why, "server_error", 503)
            yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()


def _error(message: str, kind: str, code: int | str) -> dict:
    """An OpenAI-shaped error body."""
    return {"error": {"message": message, "type": kind, "code": code}}


def _busy(why: str) -> Response:
    body = _error(f"the fleet is at capacity: {why}; retry later", "server_error", 503)
    return JSONResponse(body, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})


def _forwarded_headers(request: Request) -> list[tuple[str, str]]:
    drop = {"host", "content-length", "authorization", "connection", "transfer-encoding"}
    return [(k, v) for k, v in request.headers.items() if k.lower() not in drop]


@serve.ingress(app)
class Ingress:
    def __init__(self, config_json: str, replicas, deployment: str, app_name: str):
        self.cfg = FleetConfig.from_json(config_json)
        self.replicas = replicas
        self.view = FleetView(deployment, app_name)
        self.waiting = 0
        self._poller = asyncio.get_event_loop().create_task(self._poll())

    async def _poll(self) -> None:
        while True:
            try:
                await asyncio.to_thread(self.view.refresh, self.waiting)
            except Exception as e:  # noqa: BLE001 - the controller may be restarting
                log.debug("serve.status failed: %s", e)
            await asyncio.sleep(STATUS_POLL_S)

    def report(self, payload: dict) -> None:
        """Called by replicas (over a handle) with their start and metrics."""
        self.view.reports[payload["id"]] = payload

    @app.get("/health")
    async def health(self) -> JSONResponse:
        return JSONResponse(self.view.health(self.cfg.model_id, self.waiting))

    @app.get("/metrics")
    async def metrics(self) -> Response:
        return PlainTextResponse(
            render_metrics(self.view, self.waiting), media_type="text/plain; version=0.0.4"
        )

    @app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        if (denied := self._denied(request)) is not None:
            return denied
        card = {"id": self.cfg.model_id, "object": "model", "owned_by": "warmboot"}
        return JSONResponse({"object": "list", "data": [card]})

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def forward(self, request: Request, path: str) -> Response:
        if (denied := self._denied(request)) is not None:
            return denied
        if self.waiting >= self.cfg.max_queued_requests:
            return _busy(f"{self.waiting} requests are waiting for a replica (the bound)")
        req = {
            "method": request.method,
            "path": "/" + path,
            "query": request.url.query,
            "headers": _forwarded_headers(request),
            "body": await request.body(),
        }
        self.waiting += 1
        self.view.note_waiting()
        stream = self.replicas.options(stream=True).handle.remote(req)
        try:
            head = await asyncio.wait_for(stream.__anext__(), self.cfg.request_timeout_s)
        except BackPressureError:
            return _busy("every replica's queue is full")
        except (TimeoutError, asyncio.CancelledError) as e:
            stream.cancel()  # NOTE: no replica runs a request nobody waits for any more
            if isinstance(e, asyncio.CancelledError):
                raise
            return _busy(f"no replica took the request within {self.cfg.request_timeout_s:g} s")
        finally:
            self.waiting -= 1
        headers = dict(head["headers"])
        sse = headers.get("content-type", "").startswith("text/event-stream")
        headers.pop("content-length", None)
        return StreamingResponse(_body(stream, sse), status_code=head["status"], headers=headers)

    def _denied(self, request: Request) -> Response | None:
        key = self.cfg.api_key
        if key is None:
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), key.encode()):
            return None
        body = _error("invalid or missing API key", "authentication_error", "invalid_api_key")
        return JSONResponse(body, status_code=401)
