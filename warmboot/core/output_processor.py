"""Host-side output processing: incremental detokenization, stop strings, logprobs, and the
grouping of n > 1 completions into one ``RequestOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field

from warmboot.core.request import FinishReason, Request
from warmboot.core.types import TokenEvent, TokenLogprobs
from warmboot.outputs import CompletionOutput, Logprob, RequestOutput
from warmboot.sampling_params import SamplingParams
from warmboot.tokenizer import Detokenizer, Tokenizer


@dataclass
class CompletionState:
    """One completion's output so far. Its text is kept as the emitted pieces plus a short
    pending tail (at most the hold-back and this step's text), so a step costs O(new text):
    appending to one growing string would copy it all at every token."""

    index: int
    params: SamplingParams
    detokenizer: Detokenizer
    pending: str = ""
    """Text not yet emitted: the only part a stop string can still cut."""
    emitted_chars: int = 0
    emitted_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    hold_back: int = field(init=False)
    """Characters kept back while running: they might start a stop string (none when the
    stop string stays in the text)."""
    search_back: int = field(init=False)
    """How far before new text a stop string can start."""
    lookback: str = field(default="", init=False, repr=False)
    """The emitted text's last ``search_back`` characters, when they are not held back."""
    _emitted: list[str] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.search_back = max((len(s) for s in self.params.stop), default=1) - 1
        keep = self.params.include_stop_str_in_output
        self.hold_back = 0 if keep else self.search_back

    @property
    def text(self) -> str:
        """The whole text so far (O(length): for whole outputs, not per step)."""
        return self._emitted_text() + self.pending

    def add_text(self, piece: str) -> str | None:
        """Append detokenized text; return the stop string that ended it, if any."""
        if not piece:
            return None
        # NOTE: a stop string starts at most search_back characters back: in pending text, or
        # in the lookback when nothing is held back
        search_from = max(0, len(self.lookback) + len(self.pending) - self.search_back)
        self.pending += piece
        if not self.params.stop or len(self.token_ids) < self.params.min_tokens:
            return None
        window = self.lookback + self.pending if self.lookback else self.pending
        stops = self.params.stop
        found = [(i, s) for s in stops if (i := window.find(s, search_from)) >= 0]
        if not found:
            return None
        cut, stop = min(found)
        if self.params.include_stop_str_in_output:
            cut += len(stop)
        self.pending = self.pending[: max(cut - len(self.lookback), 0)]  # never un-emit text
        return stop

    def output(self) -> CompletionOutput:
        """What is new since the previous output, and (unless the kind is "delta") the whole
        text and tokens so far: copying those is O(length) per output."""
        total = self.emitted_chars + len(self.pending)
        visible = total if self.finish_reason else total - self.hold_back
        new = max(visible - self.emitted_chars, 0)
        delta_text, self.pending = self.pending[:new], self.pending[new:]
        delta_ids = self.token_ids[self.emitted_tokens :]
        logprobs = self.logprobs
        if self.params.output_kind == "delta":
            text, token_ids = delta_text, delta_ids
            logprobs = None if logprobs is None else logprobs[self.emitted_tokens :]
        else:
            text, token_ids = self._emitted_text() + delta_text, list(self.token_ids)
            logprobs = None if logprobs is None else list(logprobs)
        if delta_text:
            self._emitted.append(delta_text)
            if self.hold_back < self.search_back:
                self.lookback = (self.lookback + delta_text)[-self.search_back :]
        self.emitted_chars += new
        self.emitted_tokens = len(self.token_ids)
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=token_ids,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=logprobs,
            delta_text=delta_text,
            delta_token_ids=delta_ids,
        )

    def _emitted_text(self) -> str:
        if len(self._emitted) > 1:
            self._emitted[:] = ["".join(self._emitted)]
        return self._emitted[0] if self._emitted else ""


@dataclass
class RequestGroup:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    completions: list[CompletionState]
    children: list[Request]
    unfinished: int = field(init=False)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = field(init=False)
    """Per prompt token (None for the first), when asked for; complete before the first
    output token, which is when outputs start to carry it."""
    _prompt_logprobs_sent: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        self.unfinished = sum(c.finish_reason is None for c in self.completions)
        wants = self.completions[0].params.prompt_logprobs is not None
        self.prompt_logprobs = [None] if wants else None

    @property
    def finished(self) -> bool:
        return self.unfinished == 0

    @property
    def output_kind(self) -> str:
        return self.completions[0].params.output_kind

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[c.output() for c in self.completions],
            finished=self.finished,
            num_cached_tokens=self.children[0].num_cached_tokens,
            prompt_logprobs=self._prompt_logprobs_due(),
        )

    def _prompt_logprobs_due(self) -> list[dict[int, Logprob] | None] | None:
        """The prompt logprobs once complete: in every output, or in the first one only for
        "delta" outputs."""
        lps = self.prompt_logprobs
        if lps is None or len(lps) < len(self.prompt_token_ids):
            return None
        if self.output_kind == "delta":
            if self._prompt_logprobs_sent:
                return None
            self._prompt_logprobs_sent = True
        return lps


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.groups: dict[str, RequestGroup] = {}
        self.finished: set[str] = set()
        """Ids of the groups whose every completion has ended (until ``pop_finished``)."""
        self._child: dict[str, tuple[RequestGroup, CompletionState]] = {}

    def add(self, group: RequestGroup) -> None:
        self.groups[group.request_id] = group
        for child, state in zip(group.children, group.completions, strict=True):
            self._child[child.request_id] = (group, state)

    def child_ids(self, request_id: str) -> list[str]:
        group = self.groups.get(request_id)
        return [] if group is None else [c.request_id for c in group.children]

    def process(self, events: list[TokenEvent]) -> tuple[set[str], list[str]]:
        """Apply token events. Returns (touched group ids, child ids ended by a stop string)."""
        touched: set[str] = set()
        stopped: list[str] = []
        for ev in events:
            group, state = self._child[ev.req_id]
            if ev.prompt_logprobs and group.prompt_logprobs is not None:
                group.prompt_logprobs += self._prompt_logprob_dicts(group, ev.prompt_logprobs)
            if not ev.new_token_ids and not ev.finished:
                continue  # a prefill chunk's prompt logprobs: nothing to output yet
            touched.add(group.request_id)
            if state.finish_reason is not None:
                continue
            if self._apply(ev, state):
                stopped.append(ev.req_id)
            if state.finish_reason is not None:
                self._ended(group)
        return touched, stopped

    def _ended(self, group: RequestGroup) -> None:
        group.unfinished -= 1
        if not group.unfinished:
            self.finished.add(group.request_id)

    def _apply(self, ev: TokenEvent, state: CompletionState) -> bool:
        stopped_by_token = ev.finish_reason is FinishReason.STOP
        for i, (token, lp) in enumerate(zip(ev.new_token_ids, ev.new_logprobs, strict=True)):
            state.token_ids.append(token)
            if state.logprobs is not None and lp is not None:
                state.logprobs.append(self._logprob_dict(token, lp))
            last = i == len(ev.new_token_ids) - 1
            if last and stopped_by_token:
                # NOTE: EOS / stop token ids are not detokenized into the text, unless the
                # stop stays in it (vLLM; then no stop string is looked for)
                if state.params.include_stop_str_in_output:
                    state.pending += state.detokenizer.step(token)
                break
            stop = state.add_text(state.detokenizer.step(token))
            if stop is not None:
                state.finish_reason, state.stop_reason = FinishReason.STOP.value, stop
                return True
        if ev.finished:
            stop = state.add_text(state.detokenizer.flush())
            if stop is not None:
                state.finish_reason, state.stop_reason = FinishReason.STOP.value, stop
                return False
            state.finish_reason = ev.finish_reason.value
            state.stop_reason = ev.stop_reason
        return False

    def _prompt_logprob_dicts(self, group: RequestGroup, lps: list[TokenLogprobs]) -> list:
        start = len(group.prompt_logprobs)
        tokens = group.prompt_token_ids[start : start + len(lps)]
        return [self._logprob_dict(t, lp) for t, lp in zip(tokens, lps, strict=True)]

    def _logprob_dict(self, token: int, lp: TokenLogprobs) -> dict[int, Logprob]:
        text = self.tokenizer.token_text
        entries = {t: Logprob(v, text(t)) for t, v in lp.top}
        entries.setdefault(token, Logprob(lp.token_logprob, text(token)))
        return entries

    def abort(self, request_id: str) -> None:
        group = self.groups.get(request_id)
        if group is None:
            return
        for state in group.completions:
            if state.finish_reason is None:
                state.finish_reason = FinishReason.ABORT.value
                self._ended(group)

    def pop_finished(self, request_id: str) -> None:
        group = self.groups.pop(request_id)
        self.finished.discard(request_id)
        for child in group.children:
            del self._child[child.request_id]
