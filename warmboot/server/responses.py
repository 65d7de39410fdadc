"""Turn engine outputs into OpenAI response bodies and stream chunks (plain dicts).

A ``Completion`` is one ``RequestOutput`` stream (one prompt, ``n`` choices); several prompts
in one completions call are several of them, and choice ``i`` of prompt ``p`` has index
``p * n + i``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

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
def _entries(c: CompletionOutput, start: int, top_n: int):
    """(token text, sampled logprob, top-n [(text, logprob)]) per output token from ``start``."""
    for token_id, lps in zip(c.token_ids[start:], (c.logprobs or [])[start:], strict=False):
        chosen = lps.get(token_id) or Logprob(float("nan"))
        top = sorted(lps.values(), key=lambda lp: lp.logprob, reverse=True)[:top_n]
        yield (
            chosen.decoded_token or "",
            chosen.logprob,
            [(lp.decoded_token or "", lp.logprob) for lp in top],
        )


def completion_logprobs(c: CompletionOutput, start: int, top_n: int, offset: int) -> dict:
    """The completions API's column format; ``offset`` is the text offset of token ``start``."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for text, lp, top in _entries(c, start, top_n):
        tokens.append(text)
        token_lps.append(lp)
        tops.append(dict(top))
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(c: CompletionOutput, start: int, top_n: int) -> dict:
    def item(text: str, lp: float) -> dict:
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    content = [
        {**item(text, lp), "top_logprobs": [item(t, v) for t, v in top]}
        for text, lp, top in _entries(c, start, top_n)
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


def completion_body(meta: ResponseMeta, outs: list[RequestOutput], echo: list[str]) -> dict:
    choices = []
    for p, out in enumerate(outs):
        for c in out.outputs:
            prefix = echo[p] if echo else ""
            choices.append(
                {
                    "index": p * meta.n + c.index,
                    "text": prefix + c.text,
                    "logprobs": _completion_lp(meta, c, 0, len(prefix)),
                    "finish_reason": c.finish_reason,
                }
            )
    return {
        "id": meta.id,
        "object": "text_completion",
        "created": meta.created,
        "model": meta.model,
        "choices": sorted(choices, key=lambda ch: ch["index"]),
        "usage": usage(outs),
    }


def completion_chunk(meta: ResponseMeta, p: int, c: CompletionOutput, prefix: str = "") -> dict:
    start = len(c.token_ids) - len(c.delta_token_ids)
    return {
        "id": meta.id,
        "object": "text_completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [
            {
                "index": p * meta.n + c.index,
                "text": prefix + c.delta_text,
                "logprobs": _completion_lp(meta, c, start, len(c.text) - len(c.delta_text)),
                "finish_reason": c.finish_reason,
            }
        ],
    }


def _completion_lp(meta: ResponseMeta, c: CompletionOutput, start: int, offset: int):
    if meta.top_logprobs is None:
        return None
    return completion_logprobs(c, start, meta.top_logprobs, offset)


def chat_body(meta: ResponseMeta, out: RequestOutput) -> dict:
    choices = [
        {
            "index": c.index,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": _chat_lp(meta, c, 0),
            "finish_reason": c.finish_reason,
        }
        for c in out.outputs
    ]
    return {
        "id": meta.id,
        "object": "chat.completion",
        "created": meta.created,
        "model": meta.model,
        "choices": choices,
        "usage": usage([out]),
    }


def chat_chunk(meta: ResponseMeta, index: int, delta: dict, c: CompletionOutput | None) -> dict:
    logprobs = None
    if c is not None:
        logprobs = _chat_lp(meta, c, len(c.token_ids) - len(c.delta_token_ids))
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


def _chat_lp(meta: ResponseMeta, c: CompletionOutput, start: int):
    if meta.top_logprobs is None:
        return None
    return chat_logprobs(c, start, meta.top_logprobs)


def usage_chunk(meta: ResponseMeta, obj: str, outs: list[RequestOutput]) -> dict:
    return {
        "id": meta.id,
        "object": obj,
        "created": meta.created,
        "model": meta.model,
        "choices": [],
        "usage": usage(outs),
    }
