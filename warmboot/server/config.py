"""The server's own settings (``ServerConfig``): the model name it answers to, the API key,
the request body limit, and whether the debug route is on. A leaf module, so the app, the
middleware and the CLI can all share it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str
    """The model id clients must send (``model`` field) and ``/v1/models`` lists."""
    api_key: str | None = None
    """When set, ``/v1/*`` and ``/debug/*`` require ``Authorization: Bearer <key>``."""
    max_body_bytes: int = 4 << 20
    """Larger request bodies get a 413."""
    enable_debug: bool = False
    """Expose ``GET /debug/engine`` (pool invariants and engine counters)."""
    tool_call_parser: str = "auto"
    """How the model writes tool calls: hermes, llama3_json, mistral, or auto (read from the
    chat template)."""
    chat_template: str | None = None
    """A Jinja chat template used instead of the tokenizer's (``--chat-template``)."""
    trust_request_chat_template: bool = False
    """Render a request's own ``chat_template`` (vLLM's flag); refused (400) otherwise."""
