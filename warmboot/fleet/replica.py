"""One fleet replica: warmboot's engine (tier P where runsc works, tier A otherwise, a cold
boot and a publish when the store has nothing) behind warmboot's own HTTP app, which the
ingress reaches over a Serve handle: every route the single server has, the fleet has.

Serve counts a replica as starting until ``__init__`` returns, so requests wait in the
handles' queues, not here, while the engine boots.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path

from warmboot.config import ENGINE_DEFAULTS
from warmboot.fleet.config import FleetConfig

log = logging.getLogger("warmboot")
REPORT_INTERVAL_S = 1.0


class Replica:
    def __init__(self, config_json: str, ingress_name: str = "", app_name: str = ""):
        from warmboot.server.app import ServerConfig, create_app
        from warmboot.server.engine_holder import EngineHolder

        t0, began = time.monotonic(), time.time()
        self.cfg = FleetConfig.from_json(config_json)
        self.id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        client, self.start = boot_engine(self.cfg)
        self.start |= {"seconds": time.monotonic() - t0, "began": began, "ready": time.time()}
        self.holder = EngineHolder(lambda: client)
        self.holder.boot()
        self.app = create_app(self.holder, ServerConfig(served_model_name=self.cfg.model_id))
        self.reporter = _Reporter(self, ingress_name, app_name) if ingress_name else None
        log.info(
            "replica %s ready via %s in %.2f s", self.id, self.start["path"], self.start["seconds"]
        )

    async def handle(self, request: dict):
        """One HTTP request through the app: yields ``{"status", "headers"}``, then bytes."""
        messages: asyncio.Queue = asyncio.Queue()
        body, never = request.get("body", b""), asyncio.Event()
        first = True

        async def receive() -> dict:
            nonlocal first
            if first:
                first = False
                return {"type": "http.request", "body": body, "more_body": False}
            await never.wait()  # NOTE: a client that goes away cancels this call instead
            return {"type": "http.disconnect"}

        task = asyncio.ensure_future(self.app(_scope(request), receive, messages.put))
        try:
            while True:
                getter = asyncio.ensure_future(messages.get())
                await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    task.result()  # NOTE: the app ended without a full response: raise its error
                    return
                msg = getter.result()
                if msg["type"] == "http.response.start":
                    headers = [
                        (k.decode("latin-1"), v.decode("latin-1")) for k, v in msg["headers"]
                    ]
                    yield {
                        "status": msg["status"],
                        "headers": [*headers, ("x-warmboot-replica", self.id)],
                    }
                elif msg["type"] == "http.response.body":
                    if msg.get("body"):
                        yield bytes(msg["body"])
                    if not msg.get("more_body"):
                        return
        finally:
            if not task.done():
                task.cancel()

    async def metrics_text(self) -> str:
        """This replica's own ``/metrics`` exposition."""
        chunks = [c async for c in self.handle({"method": "GET", "path": "/metrics"})]
        return b"".join(c for c in chunks if isinstance(c, bytes)).decode()

    def report(self) -> dict:
        return {"id": self.id, "start": self.start, "time": time.time()}

    def __del__(self):
        if getattr(self, "reporter", None) is not None:
            self.reporter.stop()
        holder = getattr(self, "holder", None)
        if holder is not None:
            holder.shutdown()


def boot_engine(cfg: FleetConfig):
    """(engine client, start facts): through the node cache when the store is remote, with
    the fleet's publish lease when nothing of this model is in the store yet."""
    from warmboot.launcher.launch import LaunchConfig, launch

    store, cache, lease, why = _prepare_store(cfg)
    engine = cfg.engine(store)
    publish = lease is not None or cache is None
    if not publish:
        engine["snapshot_publish"] = False
    try:
        client = launch(
            LaunchConfig(engine=engine, store=store, sandbox=cfg.sandbox, publish=publish)
        )
        pushed = _push(cache, Path(cfg.model_source)) if cache is not None and publish else ""
    finally:
        if lease is not None:
            _quietly(lease.release)
    info = client.start_info
    reason = "; ".join(p for p in (info.reason, why, pushed) if p)
    return client, {"path": info.path, "reason": reason, "phases": dict(info.phase_times)}


def _push(cache, model_dir: Path, tries: int = 2) -> str:
    """Push this replica's publish to the remote store: a note for the start's reason. A
    push that fails (each try moves only the chunks still missing) leaves the replica
    serving what it booted; the next replica that holds the lease pushes again."""
    for attempt in range(1, tries + 1):
        try:
            pushed = cache.push(model_dir)
            return f"pushed {pushed}" if pushed else ""
        except Exception as e:  # noqa: BLE001 - a store error must not fail a booted replica
            log.warning("node cache push failed (try %d of %d): %s", attempt, tries, e)
            error = e
    return f"push to {cache.remote.url} failed: {error}"


def _prepare_store(cfg: FleetConfig):
    """(the store URL the engine uses, the node cache or None, the fleet lease or None, a
    note). A remote store is pulled into the node cache first; when it holds nothing of this
    model, one replica (the lease holder) boots and publishes, the others do not publish."""
    if cfg.snapshot_store is None or "://" not in cfg.snapshot_store:
        return cfg.snapshot_store, None, None, ""
    from warmboot.fleet.node_cache import NodeCache, default_cache_dir
    from warmboot.snapshot.key import model_files_digest
    from warmboot.snapshot.lease import try_lease
    from warmboot.snapshot.store import open_store

    timeout = float(cfg.engine_kwargs.get("snapshot_timeout", ENGINE_DEFAULTS["snapshot_timeout"]))
    root = Path(cfg.node_cache_dir or default_cache_dir())
    try:
        cache = NodeCache(open_store(cfg.snapshot_store), root, cfg.node_cache_bytes, timeout)
        if cache.pull(Path(cfg.model_source)):
            return (
                cache.url,
                cache,
                None,
                f"node cache {cache.url} pulled from {cfg.snapshot_store}",
            )
        digest = model_files_digest(Path(cfg.model_source))[:32]
        lease = try_lease(cache.remote, f"fleet-publish-{digest}")
    except Exception as e:  # noqa: BLE001 - an unusable remote store: boot from the cache alone
        log.warning("remote store %s unusable: %s", cfg.snapshot_store, e)
        return str(root), None, None, f"remote store unusable: {e}"
    why = "" if lease else "another replica is publishing this model; not publishing"
    return cache.url, cache, lease, why


class _Reporter:
    """Thread: this replica's start and metrics to the ingress, every ``REPORT_INTERVAL_S``
    (the ingress aggregates them for the fleet's ``/metrics``)."""

    def __init__(self, replica: Replica, ingress_name: str, app_name: str):
        from ray import serve

        self.replica = replica
        self.ingress = serve.get_deployment_handle(ingress_name, app_name)
        self.stopped = threading.Event()
        threading.Thread(target=self._run, name="fleet-report", daemon=True).start()

    def _run(self) -> None:
        while not self.stopped.wait(REPORT_INTERVAL_S):
            try:
                text = asyncio.run(self.replica.metrics_text())
                self.ingress.report.remote(self.replica.report() | {"metrics": text})
            except Exception as e:  # noqa: BLE001 - the ingress may be restarting
                log.debug("report failed: %s", e)

    def stop(self) -> None:
        self.stopped.set()


def _scope(request: dict) -> dict:
    path = request.get("path", "/")
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": request.get("method", "GET"),
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": request.get("query", "").encode(),
        "headers": [
            (k.lower().encode("latin-1"), v.encode("latin-1"))
            for k, v in request.get("headers", [])
        ],
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 80),
    }


def _quietly(fn) -> None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - best effort
        log.warning("%s failed: %s", getattr(fn, "__qualname__", fn), e)
