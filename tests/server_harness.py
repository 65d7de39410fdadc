"""A real uvicorn server on 127.0.0.1 (a free port) in a background thread, for tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import uvicorn

from warmboot import LLM
from warmboot.server.app import ServerConfig, create_app
from warmboot.server.config import HttpLimits
from warmboot.server.engine_holder import EngineHolder
from warmboot.server.http_server import http_config

MODEL_NAME = "tiny"


def small_llama(model_dir: Path) -> Path:
    """A small random Llama with the demo tokenizer (4096 tokens, 1024 positions): room for a
    tool list, which the tiny test tokenizer (512 tokens) spends its whole context on."""
    from warmboot.models.demo import write_random_llama
    from warmboot.tokenizer.train import train_tokenizer

    write_random_llama(
        model_dir,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=4096,
        tie_word_embeddings=True,
        seed=0,
        dtype="float32",
        max_position_embeddings=1024,
    )
    train_tokenizer(model_dir, 4096)
    return model_dir


def tiny_llm(path, **kw) -> LLM:
    opts = dict(max_model_len=256, block_size=4, num_kv_blocks=256, cpu_threads=1)
    return LLM(str(path), **{**opts, **kw})


@contextmanager
def running_server(
    holder: EngineHolder, http_limits: HttpLimits | None = None, **config
) -> Iterator[str]:
    """Serve ``holder`` until the block exits, on ``warmboot serve``'s HTTP layer with
    ``http_limits`` (default: its defaults); yields the base URL (``http://127.0.0.1:PORT``)."""
    app = create_app(holder, ServerConfig(served_model_name=MODEL_NAME, **config))
    options = dict(host="127.0.0.1", port=0, log_level="warning", access_log=False)
    server = uvicorn.Server(http_config(app, http_limits or HttpLimits(), **options))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        holder.shutdown()
