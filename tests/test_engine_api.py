"""End-to-end tests of the public engine API (``LLM`` / ``LLMEngine``) on the tiny llama model.

Stop strings, streaming, stop token ids, EOS, length limits, logprobs, seeds, penalties, input
validation, abort, chat templates, model loading and multi-byte detokenization. Expected values
come from transformers (``hf_greedy`` / ``hf_logits``) or from the tokenizer, never from the
engine itself, except where the test is about consistency between two engine paths.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter

import pytest
import torch

from tests.helpers import assert_engine_clean, hf_greedy, hf_logits, random_prompts, stop_window
from tests.tiny_models import FAMILY_KINDS, KINDS, VOCAB_SIZE
from warmboot import LLM, SamplingParams
from warmboot.architectures import ARCHITECTURES
from warmboot.engine.llm_engine import InvalidRequestError
from warmboot.outputs import OutputFolder

MAX_MODEL_LEN = 128
TEXT_PROMPT = "Hello world, this is a test"
REPLACEMENT = "\ufffd"


def make_llm(path, **kw) -> LLM:
    args = dict(max_model_len=MAX_MODEL_LEN, block_size=4, num_kv_blocks=64)
    args.update(kw)
    return LLM(str(path), **args)


def greedy(max_tokens=30, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def one(llm: LLM, prompt, params: SamplingParams):
    """The single completion of one prompt."""
    (out,) = llm.generate(prompt, params)
    assert out.finished
    return out.outputs[0]


def run_engine(engine, outputs: dict, steps: int | None = None) -> None:
    """Step ``engine`` (``steps`` times, or until idle), keeping the last output per request."""
    n = 0
    while engine.has_unfinished_requests() and (steps is None or n < steps):
        for out in engine.step():
            outputs[out.request_id] = out
        n += 1


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny matmuls gain nothing from two threads; with other processes on the two cores,
    spinning intra-op threads make them 20-100x slower. Restored after the module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def llm(path):
    return make_llm(path)


@pytest.fixture
def base(llm):
    """Greedy 30-token completion of TEXT_PROMPT (no EOS inside), the stop-string reference."""
    out = one(llm, TEXT_PROMPT, greedy(30))
    assert len(out.token_ids) == 30 and out.finish_reason == "length", "precondition: no EOS"
    return out


def _first_prefix_containing(tok, ids: list[int], s: str) -> int:
    """Smallest k such that decode(ids[:k]) contains s."""
    for k in range(1, len(ids) + 1):
        if s in tok.decode(ids[:k]):
            return k
    raise AssertionError(f"{s!r} never appears")


# -- 1. stop strings -----------------------------------------------------------------------------
def test_stop_string_cuts_text_before_first_occurrence(llm, base):
    tok = llm.get_tokenizer()
    text = base.text
    i, stop = stop_window(text, len(text) // 3, 4)
    out = one(llm, TEXT_PROMPT, greedy(30, stop=[stop]))
    assert out.text == text[:i]
    assert stop not in out.text
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    # Generation ended at the token that completed the stop string (which stays in token_ids).
    k = _first_prefix_containing(tok, base.token_ids, stop)
    assert k < 30
    assert out.token_ids == base.token_ids[:k]
    assert_engine_clean(llm)


def test_earliest_of_several_stop_strings_wins(llm, base):
    text = base.text
    i, early = stop_window(text, len(text) // 3, 4)
    _, late = stop_window(text, i + 6, 3)  # starts after early ends
    never = "#no such stop#"
    out = one(llm, TEXT_PROMPT, greedy(30, stop=[never, late, early]))
    assert (out.text, out.stop_reason, out.finish_reason) == (text[:i], early, "stop")
    # Two stop strings completed by the same token: the one starting first wins.
    suffix = early[1:]
    assert text.find(suffix) == i + 1, "precondition: the suffix does not occur earlier"
    out = one(llm, TEXT_PROMPT, greedy(30, stop=[suffix, early]))
    assert (out.text, out.stop_reason) == (text[:i], early)
    # A stop string that never occurs changes nothing.
    out = one(llm, TEXT_PROMPT, greedy(30, stop=[never]))
    assert (out.text, out.token_ids, out.finish_reason) == (text, base.token_ids, "length")
    assert out.stop_reason is None
    assert_engine_clean(llm)


def test_min_tokens_defers_stop_strings(llm, base):
    tok = llm.get_tokenizer()
    text = base.text
    i, stop = stop_window(text, len(text) // 3, 4)
    k = _first_prefix_containing(tok, base.token_ids, stop)  # the stop completes at token k
    # min_tokens below k: no change.
    out = one(llm, TEXT_PROMPT, greedy(30, stop=[stop], min_tokens=k - 1))
    assert (out.text, out.token_ids, out.stop_reason) == (text[:i], base.token_ids[:k], stop)
    # min_tokens beyond k: that occurrence is ignored and generation goes on.
    out = one(llm, TEXT_PROMPT, greedy(30, stop=[stop], min_tokens=k + 1))
    assert len(out.token_ids) > k + 1
    assert out.token_ids == base.token_ids[: len(out.token_ids)]
    assert out.text.startswith(text[:i] + stop)
    assert_engine_clean(llm)


# -- 2. streaming --------------------------------------------------------------------------------
def _stream_checks(llm, params: SamplingParams, stop_strings) -> None:
    final = one(llm, TEXT_PROMPT, params)
    outs = list(llm.generate_stream(TEXT_PROMPT, params))
    assert len(outs) > 1, "the request should stream in several pieces"
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    text, ids = "", []
    for o in outs:
        (c,) = o.outputs
        text += c.delta_text
        ids += c.delta_token_ids
        # Nothing past the stop point ever leaks, not even transiently.
        assert final.text.startswith(text), f"streamed {text!r} is not a prefix of the final text"
        assert all(s not in text for s in stop_strings)
        assert c.text == text and c.token_ids == ids
    last = outs[-1].outputs[0]
    assert text == final.text
    assert ids == final.token_ids
    assert (last.finish_reason, last.stop_reason) == (final.finish_reason, final.stop_reason)
    assert_engine_clean(llm)


def test_stream_without_stop_strings(llm, base):
    _stream_checks(llm, greedy(30), [])


def test_stream_with_stop_strings(llm, base):
    text = base.text
    i, stop = stop_window(text, len(text) // 3, 4)
    _, long_stop = stop_window(text, i, 7)  # a long one: a bigger hold-back while streaming
    _stream_checks(llm, greedy(30, stop=[stop]), [stop])
    _stream_checks(llm, greedy(30, stop=[long_stop]), [long_stop])
    _stream_checks(llm, greedy(30, stop=["#no such stop#"]), [])


def test_closing_a_stream_early_aborts_the_request(llm):
    stream = llm.generate_stream(TEXT_PROMPT, greedy(30, ignore_eos=True))
    first = next(stream)
    assert not first.finished
    stream.close()
    assert llm.engine.block_manager.num_used_blocks == 0
    llm.engine.step()  # delivers (and drops) the aborted request's final output
    assert_engine_clean(llm)


def test_n_completions_each_stop_at_their_own_stop_string(llm):
    kw = dict(n=3, temperature=1.0, seed=17, max_tokens=30, ignore_eos=True, logprobs=2)
    free = llm.generate(TEXT_PROMPT, SamplingParams(**kw))[0].outputs
    assert len({tuple(c.token_ids) for c in free}) == 3, "precondition: completions differ"
    _, stop = stop_window(free[0].text, len(free[0].text) // 3, 2)
    out = llm.generate(TEXT_PROMPT, SamplingParams(stop=[stop], **kw))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for ref, c in zip(free, out.outputs, strict=True):
        cut = ref.text.find(stop)
        if cut >= 0:
            assert (c.text, c.finish_reason, c.stop_reason) == (ref.text[:cut], "stop", stop)
            assert c.token_ids == ref.token_ids[: len(c.token_ids)]
        else:
            assert (c.text, c.token_ids, c.finish_reason) == (ref.text, ref.token_ids, "length")
        assert len(c.logprobs) == len(c.token_ids)
    assert out.outputs[0].finish_reason == "stop"
    assert_engine_clean(llm)


@pytest.mark.parametrize("kind", ["cumulative", "delta", "final"])
def test_output_kinds_agree(llm, kind):
    """The three output kinds of one streamed request (n=3, logprobs, a stop string) carry
    the same completions; deltas hold only what is new, cumulative outputs are snapshots."""
    kw = dict(n=3, temperature=1.0, seed=23, max_tokens=24, ignore_eos=True, logprobs=2)
    free = llm.generate(TEXT_PROMPT, SamplingParams(**kw))[0].outputs
    _, stop = stop_window(free[1].text, len(free[1].text) // 2, 2)
    ref = llm.generate(TEXT_PROMPT, SamplingParams(stop=[stop], **kw))[0]
    outs = list(
        llm.generate_stream(TEXT_PROMPT, SamplingParams(stop=[stop], output_kind=kind, **kw))
    )
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    if kind == "final":
        assert len(outs) == 1
    else:
        assert len(outs) > 3, "the request should stream in several pieces"
    folder = OutputFolder()
    for o in outs:
        folder.add(o)
        for c in o.outputs:
            assert len(c.logprobs) == len(c.token_ids)
            if kind == "delta":
                assert (c.text, c.token_ids) == (c.delta_text, c.delta_token_ids)
                assert len(c.token_ids) <= 1, "a delta holds only the step's new token"
    got = outs[-1] if kind != "delta" else folder.cumulative()
    if kind == "cumulative":  # earlier outputs are snapshots, not views that grew since
        first = outs[0].outputs[0]
        assert len(first.logprobs) == len(first.token_ids) < len(got.outputs[0].token_ids)
    for r, c in zip(ref.outputs, got.outputs, strict=True):
        assert (c.text, c.token_ids) == (r.text, r.token_ids)
        assert (c.finish_reason, c.stop_reason) == (r.finish_reason, r.stop_reason)
        assert c.logprobs == r.logprobs
    assert any(c.finish_reason == "stop" for c in got.outputs)
    assert_engine_clean(llm)


def test_unknown_output_kind_is_named():
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="partial")


# -- 3. stop_token_ids ---------------------------------------------------------------------------
def _pick_prompt(llm, position: int) -> tuple[list[int], list[int]]:
    """A prompt whose greedy token at ``position`` is new, not EOS, and has its own text."""
    tok = llm.get_tokenizer()
    prompts = random_prompts([6] * 20, VOCAB_SIZE, seed=21)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(16, ignore_eos=True))
    for p, o in zip(prompts, outs, strict=True):
        ids = o.outputs[0].token_ids
        t, before = ids[position], ids[:position]
        head = tok.decode(before)
        if (
            0 not in ids[: position + 1]
            and t not in before
            and not head.endswith(REPLACEMENT)
            and tok.decode([t]) not in ("", REPLACEMENT)
            and tok.decode([t]) not in head
        ):
            return p, ids
    raise AssertionError("precondition: no suitable prompt")


@torch.no_grad()
def _ref_min_tokens(hf, prompt, banned: set[int], min_tokens: int, max_tokens: int) -> list[int]:
    """Greedy with ``banned`` masked for the first ``min_tokens`` tokens, stopping after."""
    out: list[int] = []
    while len(out) < max_tokens:
        logits = hf_logits(hf, prompt + out)[-1]
        if len(out) < min_tokens:
            logits[list(banned)] = float("-inf")
        out.append(int(logits.argmax()))
        if len(out) > min_tokens and out[-1] in banned:
            break
    return out


def test_stop_token_ids(llm, hf):
    tok = llm.get_tokenizer()
    prompt, ids = _pick_prompt(llm, 5)
    assert ids == hf_greedy(hf, prompt, 16)
    t = ids[5]
    out = one(llm, {"prompt_token_ids": prompt}, greedy(16, stop_token_ids=[t]))
    assert out.token_ids == ids[:6]
    assert (out.finish_reason, out.stop_reason) == ("stop", t)
    assert out.text == tok.decode(ids[:5])
    assert tok.decode([t]) not in out.text

    # min_tokens: neither t nor EOS may end the output before 10 tokens.
    params = greedy(16, stop_token_ids=[t], min_tokens=10)
    out = one(llm, {"prompt_token_ids": prompt}, params)
    assert len(out.token_ids) > 10
    assert t not in out.token_ids[:10] and 0 not in out.token_ids[:10]
    assert out.token_ids == _ref_min_tokens(hf, prompt, {t, 0}, 10, 16)
    if out.token_ids[-1] == t:
        assert (out.finish_reason, out.stop_reason) == ("stop", t)
    assert_engine_clean(llm)


# -- 4. EOS from generation_config.json ----------------------------------------------------------
@pytest.mark.parametrize("as_list", [False, True])
def test_eos_from_generation_config(as_list, path, hf, tmp_path):
    llm = make_llm(path)
    tok = llm.get_tokenizer()
    prompt, ids = _pick_prompt(llm, 4)
    e = ids[4]
    eos_dir = tmp_path / "eos"
    shutil.copytree(path, eos_dir)
    gen_file = eos_dir / "generation_config.json"
    gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    gen["eos_token_id"] = [e] if as_list else e
    gen_file.write_text(json.dumps(gen))

    llm = make_llm(eos_dir)
    out = one(llm, {"prompt_token_ids": prompt}, greedy(16))
    assert out.token_ids == ids[:5] and out.token_ids[-1] == e
    assert out.finish_reason == "stop"
    assert out.stop_reason is None
    assert out.text == tok.decode(ids[:4])
    assert tok.decode([e]) not in out.text

    out = one(llm, {"prompt_token_ids": prompt}, greedy(16, ignore_eos=True))
    assert out.finish_reason == "length"
    assert out.token_ids == hf_greedy(hf, prompt, 16)
    assert_engine_clean(llm)


# -- 5. max_tokens -------------------------------------------------------------------------------
def test_max_tokens_gives_length(llm, base):
    for n in (1, 7, 30):
        out = one(llm, TEXT_PROMPT, greedy(n))
        assert out.finish_reason == "length" and out.stop_reason is None
        assert out.token_ids == base.token_ids[:n]
    assert_engine_clean(llm)


def test_max_tokens_none_runs_to_max_model_len(path, hf):
    llm = make_llm(path, max_model_len=40)
    prompt = random_prompts([9], VOCAB_SIZE, seed=4)[0]
    out = llm.generate({"prompt_token_ids": prompt}, greedy(None, ignore_eos=True))[0]
    (c,) = out.outputs
    assert len(prompt) + len(c.token_ids) == 40
    assert c.finish_reason == "length"
    assert c.token_ids == hf_greedy(hf, prompt, 40 - len(prompt))
    assert_engine_clean(llm)


# -- 6. logprobs ---------------------------------------------------------------------------------
def test_logprobs_match_transformers(llm, hf):
    tok = llm.get_tokenizer()
    prompt = random_prompts([7], VOCAB_SIZE, seed=5)[0]
    out = one(llm, {"prompt_token_ids": prompt}, greedy(10, logprobs=5, ignore_eos=True))
    ref = torch.log_softmax(hf_logits(hf, prompt + out.token_ids), dim=-1)
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 10
    for i, (token, entries) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = ref[len(prompt) - 1 + i]
        assert len(entries) >= 5
        assert token in entries
        assert abs(entries[token].logprob - float(row[token])) < 1e-4, f"position {i}"
        top_ref = row.topk(5).indices.tolist()
        top_ours = sorted(entries, key=lambda t: -entries[t].logprob)[:5]
        assert top_ours == top_ref, f"position {i}"
        for t, lp in entries.items():
            assert abs(lp.logprob - float(row[t])) < 1e-4
            assert lp.decoded_token == tok.decode([t], skip_special_tokens=False)

    # Sampled tokens outside the top-k are still reported; no logprobs unless asked.
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=10, logprobs=1, ignore_eos=True)
    out = one(llm, {"prompt_token_ids": prompt}, params)
    ref = torch.log_softmax(hf_logits(hf, prompt + out.token_ids), dim=-1)
    for i, (token, entries) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = ref[len(prompt) - 1 + i]
        assert int(row.argmax()) in entries and token in entries
        assert len(entries) == (1 if token == int(row.argmax()) else 2)
        assert abs(entries[token].logprob - float(row[token])) < 1e-4
    assert one(llm, {"prompt_token_ids": prompt}, greedy(4)).logprobs is None
    assert_engine_clean(llm)


# -- 7. seeds and penalties ----------------------------------------------------------------------
def test_seeded_request_is_batch_invariant(path):
    llm = make_llm(path)
    prompts = random_prompts([11, 5, 17, 8, 23, 3], VOCAB_SIZE, seed=6)
    target = {"prompt_token_ids": prompts[0]}
    kw = dict(temperature=1.0, top_p=0.9, max_tokens=20, ignore_eos=True)
    seeded = SamplingParams(seed=1234, **kw)
    others = [
        SamplingParams(seed=1, **kw),
        SamplingParams(seed=2, **kw),
        SamplingParams(**kw),
        SamplingParams(**kw),
        greedy(20, ignore_eos=True),
    ]
    alone = one(llm, target, seeded).token_ids
    batch = [{"prompt_token_ids": p} for p in prompts[1:]]
    mixed = llm.generate(
        [batch[0], batch[1], target, *batch[2:]], [*others[:2], seeded, *others[2:]]
    )
    assert mixed[2].outputs[0].token_ids == alone
    rev = llm.generate([target, *batch][::-1], [seeded, *others][::-1])
    assert rev[-1].outputs[0].token_ids == alone
    other_seed = one(llm, target, SamplingParams(seed=4321, **kw)).token_ids
    assert other_seed != alone
    assert alone != one(llm, target, greedy(20, ignore_eos=True)).token_ids
    assert_engine_clean(llm)
    # The per-request seed does not depend on the engine seed either.
    other_engine = make_llm(path, seed=99)
    assert one(other_engine, target, seeded).token_ids == alone
    assert_engine_clean(other_engine)


@torch.no_grad()
def _ref_penalised_greedy(hf, prompt, n, rep, presence, freq) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        logits = hf_logits(hf, prompt + out)[-1].clone()
        for t in set(prompt) | set(out):
            logits[t] = logits[t] / rep if logits[t] > 0 else logits[t] * rep
        for t, c in Counter(out).items():
            logits[t] -= freq * c + presence
        out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize(
    "rep,presence,freq",
    [(1.3, 0.5, 0.5), (1.3, 0.0, 0.0), (1.0, 0.5, 0.0), (1.0, 0.0, 0.5), (1.0, 0.0, -1.0)],
)
def test_penalties_match_hand_written_greedy(rep, presence, freq, llm, hf):
    prompt = [291, 291, 178, 326, 439, 235]  # plain greedy repeats a token 3 times at once
    n = 20
    params = greedy(
        n,
        ignore_eos=True,
        repetition_penalty=rep,
        presence_penalty=presence,
        frequency_penalty=freq,
        logprobs=1,
    )
    out = one(llm, {"prompt_token_ids": prompt}, params)
    expected = _ref_penalised_greedy(hf, prompt, n, rep, presence, freq)
    assert out.token_ids == expected
    assert expected != hf_greedy(hf, prompt, n), "precondition: the penalties change the output"
    if freq < 0:
        # Frequency counts occurrences: it must not act like a presence penalty of equal size.
        like_presence = _ref_penalised_greedy(hf, prompt, n, rep, presence + freq, 0.0)
        assert expected != like_presence, "precondition: repeated tokens matter"
    # Logprobs are those of the raw model, before the penalties.
    raw = torch.log_softmax(hf_logits(hf, prompt + out.token_ids), dim=-1)
    for i, (token, entries) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = raw[len(prompt) - 1 + i]
        assert abs(entries[token].logprob - float(row[token])) < 1e-4, f"position {i}"
        assert int(row.argmax()) in entries
    assert_engine_clean(llm)


def test_penalty_histories_leave_with_their_requests(llm):
    """The runner's per-request history tensors go when the request's slot does."""
    params = greedy(5, frequency_penalty=0.5, repetition_penalty=1.2)
    for _ in range(3):
        one(llm, {"prompt_token_ids": [5, 6, 7]}, params)
    assert len(llm.engine.runner.penalised()) == 1  # the last request's: released next step
    assert_engine_clean(llm)


def test_logit_bias_forces_and_bans_tokens_in_both_loops(path, hf):
    """+100 on a token makes greedy decoding pick it every step; -100 on the unbiased greedy
    token bans it. The sync and pipelined loops agree."""
    prompt = [291, 291, 178, 326, 439, 235]
    base = hf_greedy(hf, prompt, 8)
    outs = {}
    for pipelined in (False, True):
        llm = make_llm(path, pipelined=pipelined)
        forced = one(
            llm, {"prompt_token_ids": prompt}, greedy(8, ignore_eos=True, logit_bias={7: 100.0})
        )
        banned = one(
            llm,
            {"prompt_token_ids": prompt},
            greedy(8, ignore_eos=True, logit_bias={base[0]: -100.0}),
        )
        assert forced.token_ids == [7] * 8
        assert base[0] not in banned.token_ids and banned.token_ids != base
        outs[pipelined] = (forced.token_ids, banned.token_ids)
        assert_engine_clean(llm)
    assert outs[False] == outs[True]
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        llm.generate({"prompt_token_ids": prompt}, greedy(2, logit_bias={10**6: 1.0}))


# -- 8. bad input --------------------------------------------------------------------------------
def test_bad_requests_are_rejected_and_the_engine_keeps_serving(llm, hf):
    engine = llm.engine
    prompts = random_prompts([10, 21], VOCAB_SIZE, seed=8)
    params = greedy(12, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"ok{i}", {"prompt_token_ids": p}, params)
    results: dict = {}
    run_engine(engine, results, steps=3)
    assert len(engine.scheduler.running) == 2

    def rejected(prompt, match, p=params, request_id=None):
        before = (set(engine.outputs.groups), len(engine.scheduler.waiting))
        with pytest.raises(InvalidRequestError, match=match) as info:
            engine.add_request(request_id, prompt, p)
        assert isinstance(info.value, ValueError)
        assert (set(engine.outputs.groups), len(engine.scheduler.waiting)) == before

    rejected([1] * (MAX_MODEL_LEN + 1), r"max_model_len")
    rejected([1] * MAX_MODEL_LEN, r"max_model_len")
    rejected({"prompt_token_ids": [1] * 200}, r"200 tokens")
    rejected("", r"empty")
    rejected({"prompt": ""}, r"empty")
    rejected([], r"empty")
    rejected({"prompt_token_ids": []}, r"empty")
    rejected([1, 2, VOCAB_SIZE], rf"\[0, {VOCAB_SIZE}\)")
    rejected([1, -1, 2], rf"\[0, {VOCAB_SIZE}\)")
    rejected([3, 4], r"stop_token_ids", p=greedy(4, stop_token_ids=[VOCAB_SIZE + 5]))
    rejected([1] * 100, r"max_tokens.*max_model_len", p=greedy(MAX_MODEL_LEN - 99))
    rejected([1, 2], r"already in use", request_id="ok0")
    rejected({"text": "hi"}, r"prompt")
    engine.validate([1] * 100, greedy(MAX_MODEL_LEN - 100))  # exactly fits: accepted

    for kwargs, field in [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(n=0), "n="),
        (dict(min_tokens=5, max_tokens=3), "min_tokens"),
        (dict(logprobs=50), "logprobs"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(stop=[""]), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-2.5), "frequency_penalty"),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)

    run_engine(engine, results)
    for i, p in enumerate(prompts):
        out = results[f"ok{i}"]
        assert out.finished and out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == hf_greedy(hf, p, 12)
    assert_engine_clean(llm)

    # LLM.generate validates every prompt before queueing any.
    with pytest.raises(InvalidRequestError, match=r"prompt 1\b.*empty"):
        llm.generate(["hello", "", "world"], greedy(4))
    with pytest.raises(ValueError, match=r"prompt 2\b"):
        llm.generate([[1, 2], [3, 4], [5, VOCAB_SIZE]], greedy(4))
    with pytest.raises(ValueError, match=r"2 sampling params for 3 prompts"):
        llm.generate(["a", "b", "c"], [greedy(4), greedy(4)])
    assert not engine.has_unfinished_requests()
    assert not engine.scheduler.waiting and not engine.outputs.groups
    assert len(llm.generate(["hello", "world"], greedy(4))) == 2
    assert_engine_clean(llm)


# -- 9. abort ------------------------------------------------------------------------------------
def test_abort_running_and_waiting_requests(path, hf):
    llm = make_llm(path, max_num_seqs=3)
    engine = llm.engine
    prompts = random_prompts([9, 14, 6, 11], VOCAB_SIZE, seed=10)
    params = greedy(20, ignore_eos=True)
    for name, p in zip("abcd", prompts, strict=True):
        engine.add_request(name, {"prompt_token_ids": p}, params)
    engine.add_request("n2", {"prompt_token_ids": prompts[0]}, SamplingParams(n=2, max_tokens=20))
    results: dict = {}
    run_engine(engine, results, steps=5)
    running = {r.request_id.split("@")[0] for r in engine.scheduler.running}
    waiting = {r.request_id.split("@")[0] for r in engine.scheduler.waiting}
    assert running == {"a#0", "b#0", "c#0"}
    assert {"d#0", "n2#0", "n2#1"} <= waiting
    assert 0 < len(results["b"].outputs[0].token_ids) < 20
    stats = llm.stats()
    assert (stats["running"], stats["waiting"]) == (3, 3)
    assert stats["kv_blocks_used"] == engine.block_manager.num_used_blocks > 0

    engine.abort_request("b")  # running
    engine.abort_request("n2")  # waiting, never scheduled
    assert llm.engine.block_manager.num_used_blocks > 0
    run_engine(engine, results)

    b = results["b"].outputs[0]
    assert results["b"].finished and b.finish_reason == "abort"
    assert 0 < len(b.token_ids) < 20
    assert b.token_ids == hf_greedy(hf, prompts[1], 20)[: len(b.token_ids)]
    n2 = results["n2"]
    assert n2.finished and [c.finish_reason for c in n2.outputs] == ["abort", "abort"]
    assert all(c.token_ids == [] for c in n2.outputs)
    for name, p in zip("acd", [prompts[0], *prompts[2:]], strict=True):
        c = results[name].outputs[0]
        assert c.finish_reason == "length"
        assert c.token_ids == hf_greedy(hf, p, 20), name
    engine.abort_request("a")  # finished already: a no-op
    engine.abort_request("nope")
    stats = llm.stats()
    assert (stats["running"], stats["waiting"], stats["kv_blocks_used"]) == (0, 0, 0)
    assert_engine_clean(llm)


def test_seeded_request_id_reused_after_abort_restarts_its_stream(llm):
    engine = llm.engine
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    fresh = one(llm, {"prompt_token_ids": [5, 6, 7]}, params).token_ids
    engine.add_request("r", {"prompt_token_ids": [5, 6, 7]}, params)
    results: dict = {}
    run_engine(engine, results, steps=3)
    engine.abort_request("r")
    run_engine(engine, results)
    assert results["r"].outputs[0].finish_reason == "abort"
    engine.add_request("r", {"prompt_token_ids": [5, 6, 7]}, params)
    run_engine(engine, results)
    assert results["r"].outputs[0].token_ids == fresh
    assert_engine_clean(llm)


# -- 10. chat ------------------------------------------------------------------------------------
def test_chat_uses_the_template(llm, hf, path):
    from transformers import AutoTokenizer

    tok = llm.get_tokenizer()
    messages = [{"role": "user", "content": "hi"}]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True)
    expected = tok.encode(rendered, add_special_tokens=False)
    hf_tok = AutoTokenizer.from_pretrained(path)
    hf_text = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == hf_text
    assert expected == hf_tok.encode(hf_text, add_special_tokens=False)
    assert expected.count(tok.token_to_id("<|im_start|>")) == 2

    out = llm.chat(messages, greedy(6, ignore_eos=True))[0]
    assert out.prompt == rendered
    assert out.prompt_token_ids == expected
    assert out.outputs[0].token_ids == hf_greedy(hf, expected, 6)

    second = [
        *messages,
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "x"},
    ]
    outs = llm.chat([messages, second], greedy(3), add_generation_prompt=False)
    assert [o.prompt_token_ids for o in outs] == [
        tok.encode(
            tok.apply_chat_template(m, add_generation_prompt=False), add_special_tokens=False
        )
        for m in (messages, second)
    ]
    assert not outs[0].prompt.endswith("assistant\n")
    assert_engine_clean(llm)


# -- 11. loading ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_every_supported_architecture_loads(kind, tiny_model_dir, hf_model):
    path = tiny_model_dir(kind)
    llm = make_llm(path)
    assert llm.engine.model_config.architecture in ARCHITECTURES
    prompt = random_prompts([12], VOCAB_SIZE, seed=12)[0]
    out = one(llm, {"prompt_token_ids": prompt}, greedy(8, ignore_eos=True))
    assert out.token_ids == hf_greedy(hf_model(path), prompt, 8)
    assert_engine_clean(llm)


def test_tiny_kinds_cover_every_supported_architecture(tiny_model_dir):
    archs = {
        json.loads((tiny_model_dir(k) / "config.json").read_text())["architectures"][0]
        for k in KINDS + FAMILY_KINDS
    }
    assert archs == set(ARCHITECTURES), "every served architecture has a tiny checkpoint"


def test_unsupported_architecture_is_named(path, tmp_path):
    bad = tmp_path / "gpt2"
    shutil.copytree(path, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        make_llm(bad)


@pytest.mark.parametrize("missing", ["model.safetensors", "tokenizer.json", "config.json"])
def test_missing_file_is_named(missing, path, tmp_path):
    bad = tmp_path / "model"
    shutil.copytree(path, bad)
    (bad / missing).unlink()
    with pytest.raises(FileNotFoundError, match=missing.replace(".", r"\.")):
        make_llm(bad)


def test_sharded_checkpoint_loads(path, tmp_path):
    from safetensors.torch import load_file, save_file

    sharded = tmp_path / "sharded"
    shutil.copytree(path, sharded)
    (sharded / "model.safetensors").unlink()
    tensors = load_file(path / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, sharded / fname)
        weight_map.update(dict.fromkeys(part, fname))
    index = {"metadata": {}, "weight_map": weight_map}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))

    prompt = {"prompt_token_ids": random_prompts([15], VOCAB_SIZE, seed=13)[0]}
    params = greedy(12, ignore_eos=True)
    expected = one(make_llm(path), prompt, params).token_ids
    llm = make_llm(sharded)
    assert one(llm, prompt, params).token_ids == expected
    assert_engine_clean(llm)

    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
        make_llm(sharded)


# -- 12. multi-byte text -------------------------------------------------------------------------
MULTIBYTE_PROMPTS = ["naïve café über straße", "Zürich Köln Genève"]


def test_multibyte_text_equals_decode(llm):
    """Characters whose UTF-8 bytes come from several tokens are assembled exactly.

    Outputs whose last token leaves an incomplete UTF-8 sequence are left to
    ``test_trailing_partial_character_is_kept``.
    """
    tok = llm.get_tokenizer()
    assembled, checked = [], 0
    for prompt in MULTIBYTE_PROMPTS:
        for seed in range(1, 7):
            params = SamplingParams(temperature=1.0, seed=seed, max_tokens=40, ignore_eos=True)
            out = llm.generate(prompt, params)[0]
            assert out.prompt == prompt
            assert out.prompt_token_ids == tok.encode(prompt)
            c = out.outputs[0]
            expected = tok.decode(c.token_ids)
            streamed = "".join(o.outputs[0].delta_text for o in llm.generate_stream(prompt, params))
            assert streamed == c.text
            if expected.endswith(REPLACEMENT):
                continue
            checked += 1
            assert c.text == expected
            # Characters whose UTF-8 bytes were split over several tokens.
            assembled += [
                ch
                for ch in c.text
                if not ch.isascii()
                and ch != REPLACEMENT
                and not any(ch in tok.decode([t]) for t in c.token_ids)
            ]
    assert checked >= 4, "precondition: enough outputs end on a complete character"
    assert assembled, "precondition: some output holds a character split over tokens"
    assert_engine_clean(llm)


def test_special_tokens_in_text(llm):
    """EOS ignored: its text appears only with skip_special_tokens=False; EOS that stops the
    output is never part of the text."""
    tok = llm.get_tokenizer()
    eos_text = tok.decode([0], skip_special_tokens=False)
    stopped = one(llm, "The quick brown fox", greedy(12))
    assert stopped.token_ids[-1] == 0 and stopped.finish_reason == "stop", "precondition"
    for skip in (True, False):
        out = one(llm, "The quick brown fox", greedy(12, ignore_eos=True, skip_special_tokens=skip))
        assert 0 in out.token_ids[:-1]
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=skip)
        assert (eos_text in out.text) is not skip
        out = one(llm, "The quick brown fox", greedy(12, skip_special_tokens=skip))
        assert out.token_ids == stopped.token_ids
        assert out.text == tok.decode(out.token_ids[:-1]) and eos_text not in out.text
    assert_engine_clean(llm)


def test_trailing_partial_character_is_kept(llm):
    tok = llm.get_tokenizer()
    out = one(llm, MULTIBYTE_PROMPTS[0], greedy(40, ignore_eos=True))
    assert tok.decode(out.token_ids).endswith(REPLACEMENT), "precondition"
    assert out.text == tok.decode(out.token_ids)
    assert_engine_clean(llm)


@pytest.mark.parametrize(
    "field",
    [
        "temperature",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
    ],
)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_sampling_values_are_refused(field, value):
    with pytest.raises(ValueError, match=f"{field}=.*finite"):
        SamplingParams(**{field: value})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={3: value})


def test_a_prompt_far_too_long_is_refused_before_tokenizing(path, monkeypatch):
    llm = make_llm(path)
    tok, calls = llm.engine.tokenizer, []
    real = tok.encode
    monkeypatch.setattr(tok, "encode", lambda *a, **k: calls.append(1) or real(*a, **k))
    chars = 2 * tok.max_token_chars * (MAX_MODEL_LEN + 2)
    with pytest.raises(InvalidRequestError, match=r"at least \d+ tokens .*max_model_len is 128"):
        llm.generate("a" * chars, greedy(1))
    assert not calls, "refused without tokenizing"
    with pytest.raises(InvalidRequestError, match="max_model_len"):  # tokenized, then too long
        llm.generate("a b " * MAX_MODEL_LEN, greedy(1))
    assert calls
    with pytest.raises(InvalidRequestError, match="unpaired surrogate"):
        llm.generate("abc\ud800", greedy(1))
    assert_engine_clean(llm)
