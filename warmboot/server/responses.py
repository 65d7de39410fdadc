"""Turn engine outputs into OpenAI response bodies and stream chunks (plain dicts).

A ``Completion`` is one ``RequestOutput`` stream (one prompt, ``n`` choices); several prompts
in one completions call are several of them, and choice ``i`` of prompt ``p`` has index
``p * n + i``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from warmboot.outputs import CompletionOutput, Logprob, RequestOutput
from warmboot.server.metrics import ServerMetrics


@dataclass
class Timing:
    """Per-request latency bookkeeping for the TTFT / inter-token histograms."""

    metrics: ServerMetrics
    arrived: float = field(default_factory=time.perf_counter)
    last_token: float | None = None
    tokens: int = 0

    def observe(self, out: RequestOutput) -> None:
        new = sum(len(c.delta_token_ids) for c in out.outputs)
        if not new:
            return
        now = time.perf_counter()
        if self.last_token is None:
            self.metrics.ttft.observe(now - self.arrived)
        else:
            gap = (now - self.last_token) / new
            for _ in range(new):
                self.metrics.itl.observe(gap)
        self.last_token = now
        self.tokens += new

    def finish(self, out: RequestOutput) -> None:
        self.metrics.e2e.observe(time.perf_counter() - self.arrived)
        self.metrics.prompt_tokens.inc(len(out.prompt_token_ids))
        self.metrics.generation_tokens.inc(sum(len(c.token_ids) for c in out.outputs))
        for c in out.outputs:
            self.metrics.finished.labels(c.finish_reason or "unknown").inc()


def usage(outs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


# -- logprobs ----------------------------------------------------------------------------------
def token_id_text(token_id: int) -> str:
    """vLLM's ``return_tokens_as_token_ids``: a token named by its id, for the tokens whose
    text alone cannot be told apart (byte pieces, JSON-unsafe text)."""
    return f"token_id:{token_id}"


def _entries(c: CompletionOutput, start: int, top_n: int, as_ids: bool = False):
    """(token id, text, sampled logprob, top-n [(id, text, logprob)]) per output token from
    ``start``; ``as_ids``: texts are ``token_id:N``."""

    def text(token_id: int, lp: Logprob) -> str:
        return token_id_text(token_id) if as_ids else lp.decoded_token or ""

    for token_id, lps in zip(c.token_ids[start:], (c.logprobs or [])[start:], strict=False):
        chosen = lps.get(token_id) or Logprob(float("nan"))
        top = sorted(lps.items(), key=lambda kv: kv[1].logprob, reverse=True)[:top_n]
        yield (
            token_id,
            text(token_id, chosen),
            chosen.logprob,
            [(t, text(t, lp), lp.logprob) for t, lp in top],
        )


def _by_text(pairs) -> dict[str, float]:
    """{token text: logprob}, best first; two tokens with one text (byte pieces that decode to
    U+FFFD) keep the more likely one's logprob."""
    out: dict[str, float] = {}
    for text, lp in pairs:
        out.setdefault(text, lp)
    return out


def completion_logprobs(
    c: CompletionOutput, start: int, top_n: int, offset: int, as_ids: bool = False
) -> dict:
    """The completions API's column format; ``offset`` is the text offset of token ``start``."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for _, text, lp, top in _entries(c, start, top_n, as_ids):
        tokens.append(text)
        token_lps.append(lp)
        tops.append(_by_text((t, v) for _, t, v in top))
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(
    c: CompletionOutput, start: int, top_n: int, token_bytes=None, as_ids: bool = False
) -> dict:
    """The chat format. ``bytes`` are the token's own bytes (``token_bytes(id)``) when known:
    a token holding part of a multi-byte character decodes to U+FFFD on its own."""

    def item(token_id: int, text: str, lp: float) -> dict:
        raw = token_bytes(token_id) if token_bytes else text.encode("utf-8")
        return {"token": text, "logprob": lp, "bytes": list(raw)}

    content = [
        {**item(tid, text, lp), "top_logprobs": [item(*entry) for entry in top]}
        for tid, text, lp, top in _entries(c, start, top_n, as_ids)
    ]
    return {"content": content}


# -- bodies ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ResponseMeta:
    id: str
    model: str
    created: int
    n: int
    top_logprobs: int | None
    """None: no logprobs asked for."""
    token_bytes: Callable[[int], bytes] | None = None
    """A token id's raw bytes (the tokenizer's), for chat logprobs."""
    token_text: Callable[[int], str] | None = None
    """A token id's text (the tokenizer's), for the prompt's tokens."""
    echo_logprobs: bool = False
    """Completions with ``echo`` and ``logprobs``: the columns start with the prompt."""
    generates: bool = True
    """False for ``max_tokens=0``: the choices hold the echoed prompt only."""
    prompt_logprobs: bool = False
    """vLLM's ``prompt_logprobs`` extension: a ``prompt_logprobs`` list in the response."""
    token_ids_as_text: bool = False
    """vLLM's ``return_tokens_as_token_ids``: logprob tokens named ``token_id:N``."""
    prompt_parts: dict = field(default_factory=dict, compare=False, repr=False)
    """Per prompt, its formatted prompt logprobs (``_prompt_parts``), shared by its choices."""


def prompt_columns(meta: ResponseMeta, out: RequestOutput) -> dict:
    """The completions logprobs columns of the prompt's tokens (the first has no logprob)."""
    cols: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    cols["text_offset"], offset = [], 0
    lps = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
    for token_id, entries in zip(out.prompt_token_ids, lps, strict=True):
        text = meta.token_text(token_id) if meta.token_text else ""
        cols["tokens"].append(text)
        cols["text_offset"].append(offset)
        offset += len(text)
        if entries is None:
            cols["token_logprobs"].append(None)
            cols["top_logprobs"].append(None)
            continue
        cols["token_logprobs"].append(entries[token_id].logprob)
        top = sorted(entries.items(), key=lambda kv: kv[1].logprob, reverse=True)
        named = meta.token_ids_as_text
        cols["top_logprobs"].append(
            _by_text(
                (token_id_text(t) if named else lp.decoded_token or "", lp.logprob)
                for t, lp in top[: meta.top_logprobs]
            )
        )
    return cols


def vllm_prompt_logprobs(out: RequestOutput) -> list[dict | None] | None:
    """vLLM's shape: per prompt token None or {token id: {logprob, decoded_token}}."""
    if out.prompt_logprobs is None:
        return None
    return [None if e is None else _vllm_entry(e) for e in out.prompt_logprobs]


def _vllm_entry(entry: dict) -> dict:
    return {
        str(t): {"logprob": lp.logprob, "decoded_token": lp.decoded_token}
        for t, lp in entry.items()
    }


def _joined(first: dict | None, second: dict | None) -> dict | None:
    if first is None or second is None:
        return first or second
    return {k: first[k] + second[k] for k in first}


def _completion_choice(meta, p: int, out: RequestOutput, c, first: str | None, offset: int):
    """One completions choice with the new part of output ``c`` (``delta_text``, the tokens
    past ``len(token_ids) - len(delta_token_ids)``). ``first`` is the echoed prompt ("" when
    not echoing) on the choice's first text, None afterwards; ``offset`` is the text offset of
    the first new logprob token."""
    text, logprobs = first or "", None
    if meta.echo_logprobs and first is not None:
        logprobs = _prompt_parts(meta, p, out)[0]
    if meta.generates:
        text += c.delta_text
        start = len(c.token_ids) - len(c.delta_token_ids)
        logprobs = _joined(logprobs, _completion_lp(meta, c, start, offset))
    elif meta.top_logprobs is not None and logprobs is None:
        logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    choice = {"index": p * meta.n + c.index, "text": text, "logprobs": logprobs}
    choice["finish_reason"] = c.finish_reason if meta.generates else "length"
    if meta.prompt_logprobs and first is not None:
        choice["prompt_logprobs"] = _prompt_parts(meta, p, out)[1]
    return choice


def _prompt_parts(meta: ResponseMeta, p: int, out: RequestOutput):
    """(the echoed prompt's logprob columns, vLLM's prompt logprobs) of prompt ``p``,
    formatted once for its ``n`` choices."""
    if p not in meta.prompt_parts:
        columns = prompt_columns(meta, out) if meta.echo_logprobs else None
        vllm = vllm_prompt_logprobs(out) if meta.prompt_logprobs else None
        meta.prompt_parts[p] = (columns, vllm)
    return meta.prompt_parts[p]


def completion_body(meta: ResponseMeta, outs: list[RequestOutput], echo: list[str]) -> dict:
    choices = []
    for p, out in enumerate(outs):
        for c in out.outputs:
            prefix = echo[p] if echo else ""
            whole = replace(c, delta_token_ids=list(c.token_ids), delta_text=c.text)
            choices.append(_completion_choice(meta, p, out, whole, prefix, len(prefix)))
    body_usage = usage(outs)
    if not meta.generates:
        body_usage |= {"completion_tokens": 0, "total_tokens": body_usage["prompt_tokens"]}
    return {
        "id": meta.id,
        "object": "text_completion",
        "created": meta.created,
        "model": meta.model,
        "choices": sorted(choices, key=lambda ch: ch["index"]),
        "usage": body_usage,
    }


def completion_chunk(
    meta: ResponseMeta,
    p: int,
    out: RequestOutput,
    c: CompletionOutput,
    first: str | None,
    offset: int,
) -> dict:
    """One choice's new text (see ``_completion_choice``); ``out`` carries the prompt's
    logprobs for the choice's first chunk."""
    return {
        "id": meta.id,
        "object": "text_completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [_completion_choice(meta, p, out, c, first, offset)],
    }


def _completion_lp(meta: ResponseMeta, c: CompletionOutput, start: int, offset: int):
    if meta.top_logprobs is None:
        return None
    return completion_logprobs(c, start, meta.top_logprobs, offset, meta.token_ids_as_text)


def chat_body(meta: ResponseMeta, out: RequestOutput, tool_plan=None) -> dict:
    """``tool_plan`` (a ``tools.ToolPlan``): choices whose text holds calls get ``tool_calls``
    and the finish reason ``tool_calls``."""
    choices = []
    for c in out.outputs:
        message, called = {"role": "assistant", "content": c.text}, False
        if tool_plan is not None:
            message, called = tool_plan.message(c.text, cut=c.finish_reason == "length")
        # NOTE: a length cut stays "length" (the last call may be the one cut short)
        finish = "tool_calls" if called and c.finish_reason == "stop" else c.finish_reason
        lp = chat_lp(meta, c, 0)
        choices.append(
            {"index": c.index, "message": message, "logprobs": lp, "finish_reason": finish}
        )
    return {
        "id": meta.id,
        "object": "chat.completion",
        "created": meta.created,
        "model": meta.model,
        "choices": choices,
        "usage": usage([out]),
    } | ({"prompt_logprobs": vllm_prompt_logprobs(out)} if meta.prompt_logprobs else {})


def chat_chunk(meta: ResponseMeta, index: int, delta: dict, c: CompletionOutput | None) -> dict:
    logprobs = None
    if c is not None:
        logprobs = chat_lp(meta, c, len(c.token_ids) - len(c.delta_token_ids))
    return {
        "id": meta.id,
        "object": "chat.completion.chunk",
        "created": meta.created,
        "model": meta.model,
        "choices": [
            {
                "index": index,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": c.finish_reason if c is not None else None,
            }
        ],
    }


def chat_lp(meta: ResponseMeta, c: CompletionOutput, start: int):
    """Chat-format logprobs of ``c``'s tokens from ``start``, or None when not asked for."""
    if meta.top_logprobs is None:
        return None
    return chat_logprobs(c, start, meta.top_logprobs, meta.token_bytes, meta.token_ids_as_text)


def usage_chunk(meta: ResponseMeta, obj: str, outs: list[RequestOutput]) -> dict:
    return {
        "id": meta.id,
        "object": obj,
        "created": meta.created,
        "model": meta.model,
        "choices": [],
        "usage": usage(outs),
    }
