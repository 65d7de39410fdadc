"""A chat request rendered into the prompt the model sees: which template (the server's
``--chat-template``, a request's own ``chat_template`` where the server trusts requests with
one, else the tokenizer's), the variables given to it (``tools``, ``documents``,
``reasoning_effort``, ``chat_template_kwargs``: each one the template actually reads, else a
400 naming it, never silently dropped), ``continue_final_message`` (the last message left open
for the model to extend) and ``add_special_tokens``."""

from __future__ import annotations

from typing import Any

from warmboot.server.config import ServerConfig
from warmboot.server.fields import UnsupportedParameter

RESERVED = frozenset({"messages", "tools", "add_generation_prompt"})
"""Template variables a request's ``chat_template_kwargs`` may not set: fields of their own."""
MAX_REQUEST_TEMPLATE_CHARS = 64 << 10


def chat_prompt(tokenizer, body, tools: list[dict] | None, config: ServerConfig) -> dict:
    """``{"prompt", "prompt_token_ids"}`` of a chat request (``ChatCompletionRequest``)."""
    template = _template(body, config)
    variables = _variables(tokenizer, body, template, tools)
    conversation = body.conversation()
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            add_generation_prompt=body.add_generation_prompt,
            template=template,
            **variables,
        )
    except ValueError as e:  # no template, or the template rejected the conversation
        raise UnsupportedParameter("messages", f"cannot render the chat template: {e}") from None
    except Exception as e:  # noqa: BLE001 - jinja errors raised by the template itself
        raise UnsupportedParameter("messages", f"the chat template failed: {e}") from None
    if body.continue_final_message:
        text = _open_final(text, conversation[-1]["content"])
    # NOTE: a template holds any BOS itself; add_special_tokens (default False) adds it again.
    ids = tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
    return {"prompt": text, "prompt_token_ids": ids}


def _template(body, config: ServerConfig) -> str | None:
    if body.chat_template is None:
        return config.chat_template
    if not config.trust_request_chat_template:
        raise UnsupportedParameter(
            "chat_template",
            "a request's own chat_template is refused: start the server with "
            "--trust-request-chat-template to allow it",
        )
    if len(body.chat_template) > MAX_REQUEST_TEMPLATE_CHARS:
        raise UnsupportedParameter(
            "chat_template", f"chat_template exceeds {MAX_REQUEST_TEMPLATE_CHARS} characters"
        )
    return body.chat_template


def _variables(tokenizer, body, template: str | None, tools) -> dict[str, Any]:
    """The template's extra variables; each must be one the template reads."""
    try:
        reads = tokenizer.template_variables(template)
    except ValueError as e:
        raise UnsupportedParameter("messages", f"cannot render the chat template: {e}") from None
    except Exception as e:  # noqa: BLE001 - a template that does not parse
        raise UnsupportedParameter("chat_template", f"the chat template is invalid: {e}") from None
    given = {"tools": tools, "documents": body.documents, "reasoning_effort": body.reasoning_effort}
    given = {k: v for k, v in given.items() if v is not None}
    kwargs = body.chat_template_kwargs or {}
    clash = sorted(RESERVED.intersection(kwargs))
    if clash:
        raise UnsupportedParameter(
            "chat_template_kwargs", f"chat_template_kwargs may not set {clash}: use the fields"
        )
    for name in kwargs:
        _read_by(reads, name, "chat_template_kwargs", f"chat_template_kwargs {name!r}")
    for name in given:
        _read_by(reads, name, name, name)
    return given | kwargs


def _read_by(reads: frozenset[str], name: str, param: str, what: str) -> None:
    if name not in reads:
        raise UnsupportedParameter(
            param,
            f"{what} is not used by this model's chat template, which reads only {sorted(reads)}",
        )


def _open_final(text: str, final: str) -> str:
    """``text`` cut right after the final message's content, so the model continues it; the
    content is looked up as rendered (a template may strip its surrounding spaces)."""
    core = final.strip()
    at = text.rfind(core) if core else -1
    if at < 0:
        raise UnsupportedParameter(
            "continue_final_message",
            "continue_final_message needs a final message with content the template renders",
        )
    kept = final.lstrip()
    end = at + (len(kept) if text.startswith(kept, at) else len(core))
    return text[:end]
