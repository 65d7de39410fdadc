"""CompletionState keeps its text as emitted pieces plus a pending tail: every output it gives
must equal what the plain whole-string version gives (hold-back, stop strings, min_tokens,
the three output kinds), on random streams of text pieces."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from warmboot.core.output_processor import CompletionState
from warmboot.sampling_params import SamplingParams


class PlainState:
    """The whole-string reference: the text is one string, searched and sliced directly."""

    def __init__(self, params: SamplingParams):
        self.params, self.text, self.emitted = params, "", 0
        self.hold_back = max((len(s) for s in params.stop), default=1) - 1
        self.tokens = 0

    def add_text(self, piece: str) -> str | None:
        if not piece:
            return None
        start = max(0, len(self.text) - self.hold_back)
        self.text += piece
        if not self.params.stop or self.tokens < self.params.min_tokens:
            return None
        found = [(i, s) for s in self.params.stop if (i := self.text.find(s, start)) >= 0]
        if not found:
            return None
        cut, stop = min(found)
        self.text = self.text[: self._end(cut, stop)]
        return stop

    def _end(self, cut: int, stop: str) -> int:
        """Where the text ends once ``stop`` is found at ``cut``: before it."""
        return cut

    def output(self, finished: bool) -> tuple[str, str]:
        visible = len(self.text) if finished else len(self.text) - self.hold_back
        visible = max(visible, self.emitted)
        delta, self.emitted = self.text[self.emitted : visible], visible
        return delta, self.text[:visible]


pieces = st.lists(
    st.tuples(st.text(alphabet="ab.\n é", max_size=4), st.booleans()), min_size=1, max_size=40
)


@settings(max_examples=300, deadline=None)
@given(
    pieces,
    st.lists(st.text(alphabet="ab.\n é", min_size=1, max_size=4), max_size=3),
    st.integers(0, 6),
    st.sampled_from(["cumulative", "delta", "final"]),
)
def test_pieces_and_tail_equal_the_whole_string(stream, stop, min_tokens, kind):
    params = SamplingParams(stop=stop, min_tokens=min_tokens, output_kind=kind)
    state, plain = CompletionState(0, params, detokenizer=None), PlainState(params)
    for piece, emit in stream:
        state.token_ids.append(0)
        plain.tokens += 1
        stopped = state.add_text(piece)
        assert stopped == plain.add_text(piece)
        if stopped is not None:
            state.finish_reason = "stop"
        if emit or stopped is not None:
            out = state.output()
            delta, whole = plain.output(stopped is not None)
            assert out.delta_text == delta
            assert out.text == (delta if kind == "delta" else whole)
        assert state.text == plain.text
        if stopped is not None:
            break
