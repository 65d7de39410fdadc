"""vLLM's per-request extras: include_stop_str_in_output, spaces_between_special_tokens,
truncate_prompt_tokens, priority and allowed_token_ids.

Engine tests run the tiny llama on one thread; the priority tests drive the scheduler with the
fake runner of ``test_scheduler`` (sync and pipelined), no model."""

from __future__ import annotations

from collections import defaultdict, deque

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, decoders, models
from tokenizers import Tokenizer as HFTokenizer

from tests.helpers import assert_engine_clean, random_prompts, stop_window
from tests.test_output_state import PlainState
from tests.test_scheduler import Driver, make_request, reference_output
from tests.tiny_models import VOCAB_SIZE
from warmboot import LLM, SamplingParams
from warmboot.core.output_processor import CompletionState
from warmboot.core.request import FinishReason, RequestStatus
from warmboot.engine.llm_engine import InvalidRequestError
from warmboot.tokenizer import Tokenizer

MAX_MODEL_LEN = 128
TEXT_PROMPT = "Hello world, this is a test"
NEVER = "#no such stop#"


@pytest.fixture(scope="module")
def llm(path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLM(str(path), max_model_len=MAX_MODEL_LEN, block_size=4, num_kv_blocks=80)
    torch.set_num_threads(threads)


def greedy(max_tokens=30, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def one(llm: LLM, prompt, params: SamplingParams):
    (out,) = llm.generate(prompt, params)
    return out


@pytest.fixture(scope="module")
def base(llm):
    """Greedy 30-token completion of TEXT_PROMPT (no EOS inside)."""
    out = one(llm, TEXT_PROMPT, greedy(30)).outputs[0]
    assert len(out.token_ids) == 30 and out.finish_reason == "length", "precondition: no EOS"
    return out


# -- include_stop_str_in_output ---------------------------------------------------------------
def test_include_stop_str_keeps_the_stop_string(llm, base):
    i, stop = stop_window(base.text, len(base.text) // 3, 4)
    cut = one(llm, TEXT_PROMPT, greedy(30, stop=[stop])).outputs[0]
    kept = one(llm, TEXT_PROMPT, greedy(30, stop=[stop], include_stop_str_in_output=True))
    kept = kept.outputs[0]
    assert cut.text == base.text[:i]
    assert kept.text == base.text[: i + len(stop)] and kept.text.endswith(stop)
    assert (kept.finish_reason, kept.stop_reason) == ("stop", stop)
    assert kept.token_ids == cut.token_ids  # the same token ends both
    assert_engine_clean(llm)


def _stream(llm, params: SamplingParams) -> tuple[list[str], object]:
    """The delta texts of a streamed request and its last output."""
    outs = list(llm.generate_stream(TEXT_PROMPT, params))
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    return [o.outputs[0].text for o in outs], outs[-1].outputs[0]


def test_include_stop_str_streams_deltas_without_hold_back(llm, base):
    _, stop = stop_window(base.text, len(base.text) // 2, 5)
    params = greedy(30, stop=[stop], include_stop_str_in_output=True, output_kind="delta")
    deltas, last = _stream(llm, params)
    assert len(deltas) > 3
    assert "".join(deltas) == base.text[: base.text.find(stop) + len(stop)]
    assert last.finish_reason == "stop" and last.stop_reason == stop
    # nothing is held back: a stop string that never occurs streams like no stop string at all
    plain, _ = _stream(llm, greedy(30, output_kind="delta"))
    held, _ = _stream(llm, greedy(30, stop=[NEVER], output_kind="delta"))
    kept, _ = _stream(
        llm, greedy(30, stop=[NEVER], include_stop_str_in_output=True, output_kind="delta")
    )
    assert held != plain, "precondition: a long stop string holds text back"
    assert kept == plain
    assert_engine_clean(llm)


def test_include_stop_str_detokenizes_a_stop_token(llm, base):
    tok = llm.get_tokenizer()
    stop_id = next(t for t in base.token_ids[10:] if tok.decode([t]).strip())
    k = base.token_ids.index(stop_id) + 1
    for include, text_ids in ((False, k - 1), (True, k)):
        params = greedy(30, stop_token_ids=[stop_id], include_stop_str_in_output=include)
        out = one(llm, TEXT_PROMPT, params).outputs[0]
        assert out.token_ids == base.token_ids[:k] and out.stop_reason == stop_id
        assert out.text == tok.decode(base.token_ids[:text_ids])
    assert_engine_clean(llm)


class KeptStop(PlainState):
    """Whole-string reference of include_stop_str_in_output: a stop string found in the text
    cuts it right after the stop string; nothing is held back and emitted text stays."""

    def _end(self, cut: int, stop: str) -> int:
        return max(cut + len(stop), self.emitted)

    def output(self) -> str:
        delta, self.emitted = self.text[self.emitted :], len(self.text)
        return delta


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.text(alphabet="ab. é", max_size=4), st.booleans()), max_size=40),
    st.lists(st.text(alphabet="ab. é", min_size=1, max_size=4), min_size=1, max_size=3),
    st.integers(0, 4),
)
def test_kept_stop_strings_across_emitted_text(stream, stop, min_tokens):
    """A stop string may start in text already emitted (nothing is held back): the state
    keeps a look-back of it, and agrees with the whole-string reference."""
    params = SamplingParams(
        stop=stop, min_tokens=min_tokens, include_stop_str_in_output=True, output_kind="delta"
    )
    state, ref = CompletionState(0, params, detokenizer=None), KeptStop(params)
    for piece, emit in stream:
        state.token_ids.append(0)
        ref.tokens += 1
        stopped = state.add_text(piece)
        assert stopped == ref.add_text(piece)
        if stopped is not None:
            state.finish_reason = "stop"
        if emit or stopped is not None:
            assert state.output().delta_text == ref.output()
        assert state.text == ref.text
        if stopped is not None:
            break


# -- spaces_between_special_tokens ------------------------------------------------------------
def _wordpiece() -> Tokenizer:
    """A tokenizer whose decoder joins tokens with spaces (WordPiece), with added tokens."""
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    hf = HFTokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    hf.decoder = decoders.WordPiece()
    hf.add_special_tokens([AddedToken("[A]", special=True), AddedToken("[B]", special=True)])
    hf.add_tokens([AddedToken("<x>", special=False)])
    return Tokenizer(hf)


def _detok(tok: Tokenizer, ids: list[int], skip: bool, spaces: bool) -> str:
    d = tok.detokenizer(skip, spaces)
    return "".join(d.step(t) for t in ids) + d.flush()


def test_spaces_between_special_tokens_with_a_spacing_decoder():
    tok = _wordpiece()
    ids = [tok.token_to_id(t) for t in "[A] [B] hello [A] <x> <x> world [B]".split()]
    spaced = "[A] [B] hello [A] <x> <x> world [B]"
    assert tok.decode(ids, skip_special_tokens=False) == spaced
    assert _detok(tok, ids, skip=False, spaces=True) == spaced
    # vLLM: only between two added tokens (special or not) the separator goes
    assert _detok(tok, ids, skip=False, spaces=False) == "[A][B] hello [A]<x><x> world [B]"
    for spaces in (True, False):  # skipped special tokens: the flag changes nothing
        assert _detok(tok, ids, skip=True, spaces=spaces) == "hello <x> <x> world"


def test_spaces_between_special_tokens_is_a_no_op_for_byte_level(llm):
    tok = llm.get_tokenizer()
    start, end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    ids = [start, end, *tok.encode(" hi there"), end, end, start, *tok.encode("x")]
    whole = tok.decode(ids, skip_special_tokens=False)
    assert "<|im_end|><|im_end|><|im_start|>" in whole
    for spaces in (True, False):
        assert _detok(tok, ids, skip=False, spaces=spaces) == whole


def test_spaces_between_special_tokens_reaches_the_detokenizer(llm, monkeypatch):
    tok, seen = llm.engine.tokenizer, []
    real = tok.detokenizer
    monkeypatch.setattr(tok, "detokenizer", lambda *a: seen.append(a) or real(*a))
    specials = [tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")]
    for spaces in (True, False):
        params = greedy(
            6,
            ignore_eos=True,
            skip_special_tokens=False,
            spaces_between_special_tokens=spaces,
            allowed_token_ids=specials,
        )
        out = one(llm, TEXT_PROMPT, params).outputs[0]
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=False)
    assert seen == [(False, True), (False, False)]
    assert_engine_clean(llm)


# -- truncate_prompt_tokens -------------------------------------------------------------------
def test_truncate_prompt_tokens_keeps_the_last_k(llm):
    (ids,) = random_prompts([20], VOCAB_SIZE, seed=5)
    params = greedy(8, ignore_eos=True)
    short = one(llm, {"prompt_token_ids": ids[-7:]}, params)
    cut = one(llm, {"prompt_token_ids": ids}, greedy(8, ignore_eos=True, truncate_prompt_tokens=7))
    full = one(llm, {"prompt_token_ids": ids}, params)
    assert cut.prompt_token_ids == ids[-7:]
    assert cut.outputs[0].token_ids == short.outputs[0].token_ids
    assert full.outputs[0].token_ids != short.outputs[0].token_ids, "precondition"
    # a text prompt: its tokens are cut, its text is reported as given
    tok = llm.get_tokenizer()
    out = one(llm, TEXT_PROMPT, greedy(4, truncate_prompt_tokens=3))
    assert (out.prompt, out.prompt_token_ids) == (TEXT_PROMPT, tok.encode(TEXT_PROMPT)[-3:])
    # k beyond the prompt: nothing to cut
    out = one(llm, {"prompt_token_ids": ids}, greedy(8, ignore_eos=True, truncate_prompt_tokens=50))
    assert out.prompt_token_ids == ids and out.outputs[0].token_ids == full.outputs[0].token_ids
    assert_engine_clean(llm)


def test_truncate_prompt_tokens_minus_one_fits_the_context(llm):
    (ids,) = random_prompts([200], VOCAB_SIZE, seed=6)
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        llm.generate({"prompt_token_ids": ids}, greedy(8))
    out = one(llm, {"prompt_token_ids": ids}, greedy(8, ignore_eos=True, truncate_prompt_tokens=-1))
    assert out.prompt_token_ids == ids[-(MAX_MODEL_LEN - 8) :]
    assert len(out.outputs[0].token_ids) == 8
    # a text far too long for the context is tokenized and cut, not refused unread
    text = "a b " * (20 * MAX_MODEL_LEN)
    out = one(llm, text, greedy(2, truncate_prompt_tokens=-1))
    assert len(out.prompt_token_ids) == MAX_MODEL_LEN - 2 and out.prompt == text
    with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens=121 exceeds"):
        llm.generate({"prompt_token_ids": ids}, greedy(8, truncate_prompt_tokens=121))
    assert_engine_clean(llm)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("truncate_prompt_tokens", 0),
        ("truncate_prompt_tokens", -2),
        ("truncate_prompt_tokens", 2.0),
        ("truncate_prompt_tokens", True),
        ("priority", 1.5),
        ("priority", None),
        ("include_stop_str_in_output", 1),
        ("spaces_between_special_tokens", "no"),
        ("allowed_token_ids", []),
        ("allowed_token_ids", [3, -1]),
        ("allowed_token_ids", 7),
    ],
)
def test_bad_values_are_named(name, value):
    with pytest.raises(ValueError, match=f"invalid sampling parameter {name}="):
        SamplingParams(**{name: value})


# -- allowed_token_ids ------------------------------------------------------------------------
def test_allowed_token_ids_mask_greedy_and_random(llm):
    top = one(llm, TEXT_PROMPT, greedy(1, logprobs=5)).outputs[0]
    ranked = sorted(top.logprobs[0].items(), key=lambda kv: -kv[1].logprob)
    (first, _), (second, lp2), (third, _) = ranked[:3]
    assert top.token_ids == [first], "precondition"
    out = one(llm, TEXT_PROMPT, greedy(1, logprobs=0, allowed_token_ids=[third, second]))
    c = out.outputs[0]
    assert c.token_ids == [second]
    assert c.logprobs[0][second].logprob == pytest.approx(lp2.logprob)  # the raw model's
    allowed = [third, second, 42]
    params = SamplingParams(
        temperature=10.0, seed=1, max_tokens=24, ignore_eos=True, allowed_token_ids=allowed
    )
    out = one(llm, TEXT_PROMPT, params).outputs[0]
    assert set(out.token_ids) <= set(allowed) and len(set(out.token_ids)) > 1
    with pytest.raises(InvalidRequestError, match="allowed_token_ids"):
        llm.generate(TEXT_PROMPT, greedy(2, allowed_token_ids=[VOCAB_SIZE]))
    assert_engine_clean(llm)


# -- priority (scheduler) ---------------------------------------------------------------------
def _first_steps(d: Driver) -> list[str]:
    order: list[str] = []
    for o in d.outs:
        order += [s.req_id for s in o.scheduled if s.req_id not in order]
    return order


@pytest.mark.parametrize("prioritised", [False, True])
def test_full_batch_admits_a_later_high_priority_request_first(prioritised):
    d = Driver(block_size=4, max_num_seqs=1)
    reqs = [
        make_request(name, 5, max_tokens=3, priority=pri if prioritised else 0)
        for name, pri in (("a", 3), ("b", 3), ("c", 1), ("h", -2), ("d", 1))
    ]
    d.add(reqs[0])
    d.step()  # a runs; the batch is full
    d.add(*reqs[1:])
    d.run()
    want = ["a", "h", "c", "d", "b"] if prioritised else ["a", "b", "c", "h", "d"]
    assert _first_steps(d) == want
    for r in reqs:
        assert r.output_token_ids == reference_output(r)


@pytest.mark.parametrize("prioritised", [False, True])
def test_memory_pressure_preempts_the_low_priority_request(prioritised):
    d = Driver(num_blocks=4, block_size=2, budget=64)
    low = make_request("low", 3, max_tokens=5, priority=5 if prioritised else 0)
    high = make_request("high", 4, max_tokens=5)
    d.add(low)
    d.step()  # low alone: 2 blocks
    d.add(high)
    d.step()  # high admitted after low: 2 blocks, the pool is full
    later = make_request("later", 1, max_tokens=1)
    d.add(later)
    out = d.step()  # the first served needs a third block: the last in line is preempted
    victim, kept = (low, high) if prioritised else (high, low)  # FCFS: the newest goes
    assert out.preempted_req_ids == [victim.request_id]
    assert [s.req_id for s in out.scheduled] == [kept.request_id]
    assert victim.status is RequestStatus.WAITING and d.kv.block_table(victim.request_id) == []
    # a preempted request goes first among its priority, behind more urgent ones
    assert list(d.sched.waiting) == ([later, low] if prioritised else [high, later])
    d.run()
    for r in (low, high, later):
        assert r.output_token_ids == reference_output(r)
        assert r.finish_reason is FinishReason.LENGTH


@st.composite
def prioritised_workloads(draw):
    reqs = [
        dict(
            id=f"q{i}",
            prompt=draw(st.integers(1, 30)),
            max_tokens=draw(st.integers(1, 12)),
            arrival=draw(st.integers(0, 6)),
            priority=draw(st.integers(-2, 2)),
        )
        for i in range(draw(st.integers(2, 7)))
    ]
    bs = draw(st.sampled_from([1, 2, 4]))
    need = max(-(-(r["prompt"] + r["max_tokens"]) // bs) for r in reqs)
    return dict(
        reqs=reqs,
        bs=bs,
        num_blocks=need + draw(st.sampled_from([0, 1, 3, 1000])),
        budget=draw(st.integers(1, 48)),
        max_num_seqs=draw(st.integers(1, 4)),
        pipelined=draw(st.booleans()),
    )


def _check_priority_step(d: Driver, fresh: list, out) -> None:
    """No request starts while a more urgent one that never ran still waits; every victim is
    at least as low in priority as every request left running."""
    started = {s.req_id for s in out.scheduled}
    for r in fresh:
        if r.request_id in started:
            passed = [
                w
                for w in fresh
                if w.request_id not in started and w.params.priority < r.params.priority
            ]
            assert not passed, (r.request_id, [w.request_id for w in passed])
    low = min((r.params.priority for r in d.sched.running), default=None)
    for rid in out.preempted_req_ids:
        victim = d.sched.requests[rid]
        assert all(victim.params.priority >= r.params.priority for r in d.sched.running)
        assert low is None or victim.params.priority >= low


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=prioritised_workloads())
def test_random_prioritised_workloads(w):
    d = Driver(
        num_blocks=w["num_blocks"],
        block_size=w["bs"],
        budget=w["budget"],
        max_num_seqs=w["max_num_seqs"],
    )
    arrivals = defaultdict(list)
    made = []
    for spec in w["reqs"]:
        r = make_request(spec["id"], spec["prompt"], spec["max_tokens"], priority=spec["priority"])
        arrivals[spec["arrival"]].append(r)
        made.append(r)
    in_flight: deque = deque()
    for step in range(2000):
        d.add(*arrivals.get(step, []))
        if step > max(arrivals) and not (d.sched.has_unfinished() or in_flight):
            break
        fresh = [r for r in d.sched.waiting if r.num_preemptions == 0]
        if not w["pipelined"]:
            if d.sched.has_unfinished():
                _check_priority_step(d, fresh, d.step())
            continue
        if d.sched.has_unfinished():
            in_flight.append(d.launch())
            _check_priority_step(d, fresh, in_flight[-1][0])
        while len(in_flight) > 1 or (in_flight and not d.sched.has_unfinished()):
            d.commit(in_flight.popleft())
    else:
        raise AssertionError("did not finish")
    assert d.kv.num_used_blocks == 0 and not d.sched.requests
    for r in made:
        assert r.output_token_ids == reference_output(r)
        assert r.finish_reason is FinishReason.LENGTH
