"""``warmboot serve``: the API on uvicorn, in front of an engine that boots in the background.

The server listens at once (``/health`` answers 503 with the start-up phase until the engine
is ready) and stops, so the command exits non-zero, when the boot fails: nothing retries it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from warmboot.server.app import ServerConfig, create_app
from warmboot.server.config import HttpLimits
from warmboot.server.engine_holder import EngineHolder
from warmboot.server.http_server import http_config

log = logging.getLogger("warmboot")


def serve(
    holder: EngineHolder,
    config: ServerConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "warning",
    on_listening: Callable[[str], None] | None = None,
    limits: HttpLimits | None = None,
) -> None:
    """Serve until interrupted or the boot fails; ``holder`` is booting (or booted) the
    engine already. ``on_listening(url)`` hears the bound address (the real port for 0).
    The engine is shut down on the way out (a boot still under way is not waited for:
    ``warmboot serve`` then exits without it). ``limits``: the HTTP limits (defaults)."""
    app = create_app(holder, config)
    if host not in ("127.0.0.1", "localhost", "::1") and config.api_key is None:
        log.warning("serving on %s without an API key: anyone who can reach it can use it", host)
    _raise_fd_limit()
    options = dict(host=host, port=port, log_level=log_level, access_log=False)
    uv_config = http_config(app, limits or HttpLimits(), **options)
    server = _server(uv_config, on_listening)

    def stop(reason: str) -> None:  # NOTE: the model cannot be served: exit, not 503 for ever
        server.should_exit = True

    holder.on_fatal = stop
    if holder.fatal is not None:
        return
    try:
        server.run()
    finally:
        holder.shutdown()


def _server(config, on_listening: Callable[[str], None] | None):
    """A ``uvicorn.Server`` that reports its address once bound."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if on_listening is not None and self.started:
                on_listening(_url(self, config.host))

    return Server(config)


def _url(server, host: str) -> str:
    try:
        port = server.servers[0].sockets[0].getsockname()[1]
    except (AttributeError, IndexError):  # NOTE: a Unix socket or an fd: no port to show
        return host
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{port}"


def _raise_fd_limit() -> None:
    """The soft descriptor limit up to the hard one: the connection cap is lowered to what
    the soft limit allows."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError):  # NOTE: not raisable here: keep the cap lower
        pass


def default_model_name(model_dir: str) -> str:
    return Path(model_dir).resolve().name
