"""The server's own settings (``ServerConfig``): the model name it answers to, the API key,
the request body limit, admission limits (``AdmissionLimits``), the HTTP limits
(``HttpLimits``), chat templates, and whether the debug route is on: each a ``setting``, so
``serve``'s options are derived from them. A leaf module, so the app, the middleware and the
CLI can all share it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from warmboot.config import ENGINE_DEFAULTS
from warmboot.options import setting

LIMITS = "limits"
"""The ``--help`` group of admission control and the HTTP limits: past them a call gets a
429, 400, 408, 413 or 431."""


@dataclass(frozen=True)
class AdmissionLimits:
    """Admission control (``admission``): a call's cost and the server's capacity."""

    max_num_seqs: int = ENGINE_DEFAULTS["max_num_seqs"]
    """The engine's running batch (its ``max_num_seqs``): sequences beyond it wait."""
    max_queued_requests: int = setting(
        256, "sequences that may wait beyond --max-num-seqs; past it a 429 with Retry-After"
    )
    max_queued_tokens: int = setting(
        1 << 18, "prompt tokens that may be in flight (running or waiting); past it a 429"
    )
    max_prompts_per_request: int = setting(256, "prompts in one completions call (a 400 past it)")
    max_seqs_per_request: int = setting(
        256, "prompts x n of one call (a 400 past it; each sequence at most the context)"
    )
    max_prompt_logprob_tokens: int = setting(
        1 << 15, "prompt tokens whose logprobs one call asks for, prompts x length (a 400 past it)"
    )


@dataclass(frozen=True)
class HttpLimits:
    """What one connection may hold (``server.http_server``)."""

    max_header_bytes: int = setting(64 << 10, "request line and headers (a 431 past it)")
    header_timeout_s: float = setting(
        10.0,
        "seconds a request's head may take to arrive, from the connection's opening or a later "
        "request's first byte (then the connection is closed)",
        flag="--header-timeout",
    )
    body_timeout_s: float = setting(
        30.0, "seconds a request body may stall (a 408)", flag="--body-timeout"
    )
    keep_alive_timeout_s: float = setting(
        5.0, "seconds an idle keep-alive connection stays open", flag="--keep-alive-timeout"
    )
    max_connections: int = setting(
        1000,
        "open connections (capped below the file descriptor limit); past it the longest idle "
        "one is closed",
    )


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str = setting(
        help="the model id clients send and /v1/models lists (default: the model directory's name)"
    )
    api_key: str | None = setting(
        None, "require 'Authorization: Bearer KEY' on /v1 and /debug (default: $WARMBOOT_API_KEY)"
    )
    max_body_bytes: int = setting(4 << 20, "larger request bodies get a 413", group=LIMITS)
    enable_debug: bool = setting(
        False,
        "expose GET /debug/engine (pool invariants, engine counters)",
        flag="--debug-endpoints",
    )
    tool_call_parser: str = setting(
        "auto",
        "how the model writes tool calls (auto: read the chat template)",
        choices=("auto", "hermes", "llama3_json", "mistral"),
    )
    chat_template: str | None = setting(
        None,
        "the chat template to render chats with instead of the tokenizer's: a path to a Jinja "
        "file, or the template itself (as vLLM's flag)",
    )
    """The template's text here (``read_chat_template``)."""
    admission: AdmissionLimits = setting(factory=AdmissionLimits, group=LIMITS)
    client_id_header: str | None = setting(
        None,
        "a header that names the client, set by a trusted proxy (fair scheduling and "
        "per-client shares; default: the peer address)",
        group=LIMITS,
    )
    trust_request_chat_template: bool = setting(
        False, "render a request's own chat_template (refused with a 400 otherwise)"
    )
    lora_modules: tuple[str, ...] = setting(
        (),
        "LoRA adapters served by name (needs --enable-lora), as vLLM's: NAME=PATH, or JSON "
        '{"name": ..., "path": ..., "base_model_name": ...}; a request\'s model names one',
        metavar="NAME=PATH",
    )
    """The items as given (``server.adapters.parse_lora_modules`` reads them)."""


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
