"""``warmboot serve``: boot the engine in the background and serve the API with uvicorn."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from warmboot.engine.client import EngineClient
from warmboot.server.app import ServerConfig, create_app
from warmboot.server.engine_holder import EngineHolder

log = logging.getLogger("warmboot")


def serve(
    engine_factory: Callable[[], EngineClient],
    config: ServerConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "warning",
) -> None:
    import uvicorn

    holder = EngineHolder(engine_factory, started_at=time.monotonic() - process_age())
    holder.start()
    app = create_app(holder, config)
    if host not in ("127.0.0.1", "localhost", "::1") and config.api_key is None:
        log.warning("serving on %s without an API key: anyone who can reach it can use it", host)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False)
    finally:
        holder.shutdown()


def default_model_name(model_dir: str) -> str:
    return Path(model_dir).resolve().name


def process_age() -> float:
    """Seconds since this process started (0 where /proc is unavailable)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started_ticks = int(fields[19])  # field 22 of stat(5), counted after the comm field
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0
