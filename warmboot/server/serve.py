"""``warmboot serve``: the API on uvicorn, in front of an engine that boots in the background."""

from __future__ import annotations

import logging
from pathlib import Path

from warmboot.server.app import ServerConfig, create_app
from warmboot.server.engine_holder import EngineHolder

log = logging.getLogger("warmboot")


def serve(
    holder: EngineHolder,
    config: ServerConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "warning",
) -> None:
    """Serve until interrupted; ``holder`` is booting (or booted) the engine already."""
    import uvicorn

    app = create_app(holder, config)
    if host not in ("127.0.0.1", "localhost", "::1") and config.api_key is None:
        log.warning("serving on %s without an API key: anyone who can reach it can use it", host)
    server = uvicorn.Server(
        uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False)
    )

    def stop(reason: str) -> None:  # NOTE: the model cannot be served: exit, not 503 for ever
        server.should_exit = True

    holder.on_fatal = stop
    if holder.fatal is not None:
        return
    try:
        server.run()
    finally:
        holder.shutdown()


def default_model_name(model_dir: str) -> str:
    return Path(model_dir).resolve().name
