"""The server's own settings (``ServerConfig``): the model name it answers to, the API key,
the request body limit, admission limits (``AdmissionLimits``), chat templates, and whether
the debug route is on. A leaf module, so the app, the
middleware and the CLI can all share it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class AdmissionLimits:
    """Admission control (``admission``): a call's cost and the server's capacity."""

    max_num_seqs: int = 64
    """The engine's running batch: sequences beyond it wait."""
    max_queued_requests: int = 256
    """Sequences that may wait beyond the running batch."""
    max_queued_tokens: int = 1 << 18
    """Prompt tokens that may be in flight (running or waiting)."""
    max_prompts_per_request: int = 256
    max_seqs_per_request: int = 256
    """Prompts x ``n`` of one call (each sequence at most the context: this bounds the
    call's total tokens too)."""
    max_prompt_logprob_tokens: int = 1 << 15
    """Prompt tokens whose logprobs one call asks for (prompts x prompt length)."""


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
    admission: AdmissionLimits = field(default_factory=AdmissionLimits)
    client_id_header: str | None = None
    """A header naming the client (fair scheduling, per-client shares), set by a trusted
    proxy; None: the peer address names it (``--client-id-header``)."""
    trust_request_chat_template: bool = False
    """Render a request's own ``chat_template`` (vLLM's flag); refused (400) otherwise."""


def read_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file's text, or the value itself when it reads as a template
    (as vLLM: a value without any of ``{}`` or a newline must be a file that exists)."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if not any(c in value for c in "{}\n"):
        raise FileNotFoundError(f"--chat-template {value!r}: no such file")
    return value
