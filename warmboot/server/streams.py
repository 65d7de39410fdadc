"""Reading the engine's request streams on behalf of a handler, with no HTTP in it:
queueing a call's prompts all-or-none (``add_all``), collecting each stream's final output
or merging several streams' deltas as they arrive while feeding the latency metrics
(``StreamReader``), aborting whatever is left when the handler stops, and remembering what a
streamed response has already sent per choice (``SentChoices``).
"""

from __future__ import annotations

import asyncio
import uuid

from warmboot.core.errors import InvalidRequestError
from warmboot.engine.client import RequestStream
from warmboot.outputs import OutputFolder, RequestOutput
from warmboot.sampling_params import SamplingParams
from warmboot.server import responses as R
from warmboot.server.metrics import ServerMetrics


async def add_all(
    llm, prompts: list, params: SamplingParams, client: str = "", lora_request=None
) -> list[RequestStream]:
    """Queue every prompt, or none: a bad one aborts those already queued. The prompts form
    one group of ``client``'s: the scheduler takes clients, then their calls, in turn, so a
    client's flood of calls cannot hold back another client, nor a call of many prompts a
    call of one. ``lora_request``: the LoRA adapter they all run with (None: the base)."""
    streams: list[RequestStream] = []
    group = f"call-{uuid.uuid4().hex}"
    lora = {} if lora_request is None else {"lora_request": lora_request}
    try:
        for i, prompt in enumerate(prompts):
            try:
                added = llm.add_request(prompt, params, group=group, client=client, **lora)
                streams.append(await added)
            except InvalidRequestError as e:
                where = f"prompt {i}: " if len(prompts) > 1 else ""
                raise InvalidRequestError(f"{where}{e}") from None
    except BaseException:
        for s in streams:
            s.abort()
        raise
    return streams


class StreamReader:
    """Consumes request streams, timing them into ``metrics``; aborts them when done."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    async def finals(self, streams: list[RequestStream]) -> list[RequestOutput]:
        async def last(stream: RequestStream) -> RequestOutput:
            timing, folder = R.Timing(self.metrics), OutputFolder()
            async for out in stream:
                timing.observe(out)
                folder.add(out)
            final = folder.cumulative()
            timing.finish(final)
            return final

        tasks = [asyncio.ensure_future(last(s)) for s in streams]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()
            self.abort(streams)

    async def merge(self, streams: list[RequestStream], finals: dict[int, RequestOutput]):
        """Yield (prompt index, delta output) from several streams as they arrive; each
        stream's whole output goes into ``finals`` when it ends."""
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(p: int, stream: RequestStream) -> None:
            timing, folder = R.Timing(self.metrics), OutputFolder()
            try:
                async for out in stream:
                    timing.observe(out)
                    folder.add(out)
                    if out.finished:
                        finals[p] = folder.cumulative()
                        timing.finish(finals[p])
                    await merged.put((p, out))
            except Exception as e:  # noqa: BLE001 - re-raised in the consumer
                await merged.put((p, e))

        tasks = [asyncio.ensure_future(pump(p, s)) for p, s in enumerate(streams)]
        try:
            remaining = len(streams)
            while remaining:
                p, item = await merged.get()
                if isinstance(item, Exception):
                    raise item
                remaining -= item.finished
                yield p, item
        finally:
            for task in tasks:
                task.cancel()
            self.abort(streams)

    def abort(self, streams: list[RequestStream]) -> None:
        """Abort what is still running (the client left, or a sibling prompt failed)."""
        for s in streams:
            s.abort()
        self.metrics.aborted.inc(sum(s.aborted for s in streams))


class SentChoices:
    """What a stream has sent per choice (prompt index, choice index): whether it started,
    whether its finish went out (an engine output repeats finished siblings' last state), and
    the text offset of its next logprob token."""

    def __init__(self):
        self._ended: set[tuple[int, int]] = set()
        self._offsets: dict[tuple[int, int], int] = {}

    def pending(self, meta: R.ResponseMeta, p: int, c) -> bool:
        """New text, the end, or (with logprobs) new tokens whose text is still held back."""
        if (p, c.index) in self._ended:
            return False
        return bool(
            c.delta_text or c.finished or (meta.top_logprobs is not None and c.delta_token_ids)
        )

    def first(self, p: int, c) -> bool:
        return (p, c.index) not in self._offsets

    def offset(self, p: int, c) -> int:
        return self._offsets.get((p, c.index), 0)

    def end(self, p: int, c) -> None:
        """Nothing more goes out for this choice (``max_tokens=0``: the prompt was all)."""
        self._ended.add((p, c.index))

    def record(self, p: int, c, logprobs: dict | None, offset: int, skip: int = 0) -> None:
        """A chunk went out whose output tokens start at text ``offset``; the first ``skip``
        logprob tokens are the echoed prompt's."""
        tokens = logprobs["tokens"][skip:] if logprobs else ()
        self._offsets[(p, c.index)] = offset + sum(len(t) for t in tokens)
        if c.finished:
            self._ended.add((p, c.index))


class UsageSoFar:
    """vLLM's ``stream_options.continuous_usage_stats``: every streamed chunk carries the
    usage so far (prompt tokens of the prompts seen, tokens generated up to that chunk)."""

    def __init__(self, on: bool):
        self.on, self._prompts, self._generated = on, {}, 0

    def add(self, p: int, out: RequestOutput) -> None:
        self._prompts[p] = len(out.prompt_token_ids)
        self._generated += sum(len(c.delta_token_ids) for c in out.outputs)

    def stamp(self, chunk: dict) -> dict:
        if self.on:
            prompt = sum(self._prompts.values())
            chunk["usage"] = {
                "prompt_tokens": prompt,
                "completion_tokens": self._generated,
                "total_tokens": prompt + self._generated,
            }
        return chunk
