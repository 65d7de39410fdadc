"""The chunks of a streamed completion or chat completion, read from the engine's request
streams: text as it comes, logprobs, the usage so far (vLLM's ``continuous_usage_stats``) and
at the end; with tools, content held back from where a call may begin and the calls sent
whole at the end (``tool_chunks``)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from warmboot.outputs import RequestOutput
from warmboot.server import responses as R
from warmboot.server import tools as tools_mod
from warmboot.server.streams import SentChoices, StreamReader, UsageSoFar


async def completion_chunks(
    reader: StreamReader, meta, streams, echo, include_usage, so_far: UsageSoFar
) -> AsyncIterator[dict]:
    finals: dict[int, RequestOutput] = {}
    sent, firsts = SentChoices(), {}
    async for p, out in reader.merge(streams, finals):
        so_far.add(p, out)
        firsts.setdefault(p, out)  # NOTE: the one delta output carrying prompt logprobs
        for c in out.outputs:
            if not sent.pending(meta, p, c):
                continue
            first = (echo[p] if echo else "") if sent.first(p, c) else None
            offset = sent.offset(p, c) + len(first or "")
            chunk = R.completion_chunk(meta, p, firsts[p], c, first, offset)
            skip = (
                len(firsts[p].prompt_token_ids) if meta.echo_logprobs and first is not None else 0
            )
            sent.record(p, c, chunk["choices"][0]["logprobs"], offset, skip)
            if not meta.generates:
                sent.end(p, c)
            yield so_far.stamp(chunk)
    if include_usage:
        yield R.usage_chunk(meta, "text_completion", [finals[p] for p in sorted(finals)])


async def chat_chunks(
    reader: StreamReader, meta, stream, n: int, include_usage, so_far: UsageSoFar, tool_plan=None
) -> AsyncIterator[dict]:
    for i in range(n):
        yield R.chat_chunk(meta, i, {"role": "assistant", "content": ""}, None)
    finals: dict[int, RequestOutput] = {}
    sent = SentChoices()
    calls = {i: tools_mod.ToolStream(tool_plan) for i in range(n)} if tool_plan else {}
    async for _, out in reader.merge([stream], finals):
        so_far.add(0, out)
        for c in out.outputs:
            if not sent.pending(meta, 0, c):
                continue
            sent.record(p=0, c=c, logprobs=None, offset=0)
            if tool_plan is None:
                delta = {"content": c.delta_text} if c.delta_text or not c.finished else {}
                yield so_far.stamp(R.chat_chunk(meta, c.index, delta, c))
            else:
                for chunk in tool_chunks(meta, c, calls[c.index]):
                    yield so_far.stamp(chunk)
    if include_usage and finals:
        yield R.usage_chunk(meta, "chat.completion.chunk", [finals[0]])


def tool_chunks(meta, c, calls: tools_mod.ToolStream) -> list[dict]:
    """A choice's chunks when it may call tools: content held back from where a call may
    begin; at the end the rest of the content, then the calls and ``tool_calls`` as finish."""
    content = calls.feed(c.delta_text)
    if not c.finished:
        return [R.chat_chunk(meta, c.index, {"content": content}, c)] if content else []
    rest, found = calls.finish(cut=c.finish_reason == "length")
    chunks = []
    if content + rest:
        chunk = R.chat_chunk(meta, c.index, {"content": content + rest}, c)
        chunk["choices"][0]["finish_reason"] = None
        chunks.append(chunk)
    final = R.chat_chunk(meta, c.index, {"tool_calls": found} if found else {}, c)
    if chunks:  # the step's logprobs went out with its content
        final["choices"][0]["logprobs"] = None
    if found and c.finish_reason == "stop":
        final["choices"][0]["finish_reason"] = "tool_calls"
    return [*chunks, final]
