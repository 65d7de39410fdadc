"""Tests for warmboot.device.sampler: greedy, penalties, seeding, filters, suppression, logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from warmboot.device.sampler import (
    Sampler,
    SamplingRow,
    TokenHistory,
    apply_filters,
    apply_logit_bias,
    apply_penalties,
    make_generator,
)
from warmboot.sampling_params import SamplingParams

SAMPLER = Sampler()


def row(params=None, prompt=(), output=(), suppress=()) -> SamplingRow:
    params = params or SamplingParams()
    gen = None if params.seed is None else make_generator(params.seed)
    return SamplingRow(params, list(prompt), list(output), gen, list(suppress))


def fixed_logits(key: int, vocab: int, scale: float = 3.0) -> torch.Tensor:
    """(vocab,) float32 logits that depend only on ``key``."""
    return torch.randn(vocab, generator=make_generator(key)) * scale


# --- reference implementations -------------------------------------------------------------


def ref_penalties(logits: list[float], r: SamplingRow) -> list[float]:
    p = r.params
    seen = set(r.prompt_token_ids) | set(r.output_token_ids)
    out = []
    for tok, x in enumerate(logits):
        if tok in seen:
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        count = list(r.output_token_ids).count(tok)
        x -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
        out.append(x)
    return out


def ref_allowed(logits: list[float], p: SamplingParams) -> set[int]:
    """Tokens min-p, then top-k, then top-p keep, computed in float64 on T-scaled logits."""
    allowed = set(range(len(logits)))

    def probs(keep):
        m = max(logits[t] for t in keep)
        w = {t: math.exp(logits[t] - m) for t in keep}
        z = sum(w.values())
        return {t: v / z for t, v in w.items()}

    if p.min_p > 0:
        pr = probs(allowed)
        top = max(pr.values())
        allowed = {t for t in allowed if pr[t] >= p.min_p * top}
    if p.top_k > 0:
        kth = sorted((logits[t] for t in allowed), reverse=True)[min(p.top_k, len(allowed)) - 1]
        allowed = {t for t in allowed if logits[t] >= kth}
    if p.top_p < 1.0:
        pr = probs(allowed)
        kept, mass = set(), 0.0
        for t in sorted(allowed, key=lambda t: -pr[t]):
            kept.add(t)
            mass += pr[t]
            if mass >= p.top_p:
                break
        allowed = kept
    return allowed


def ref_distribution(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    scaled = (logits.double() / p.temperature).tolist()
    allowed = ref_allowed(scaled, p)
    mask = torch.tensor([t in allowed for t in range(len(scaled))])
    return torch.softmax(torch.tensor(scaled).masked_fill(~mask, -math.inf), dim=-1)


def frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / tokens.numel()


# --- greedy ---------------------------------------------------------------------------------


def test_greedy_is_argmax_fast_path():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    logits[2, [7, 30]] = 100.0  # tie -> lowest index
    out = SAMPLER(logits, [row(SamplingParams(temperature=0.0)) for _ in range(6)])
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    assert out.token_ids.dtype == torch.int64 and out.token_ids[2] == 7
    assert out.sampled_logprobs is None and out.top_logprobs is None and out.top_token_ids is None


def test_greedy_rows_in_mixed_batch_are_argmax():
    torch.manual_seed(1)
    logits = torch.randn(4, 40, dtype=torch.bfloat16)
    rows = [
        row(SamplingParams(temperature=0.0)),
        row(SamplingParams(temperature=1.0)),
        row(SamplingParams(temperature=0.0, seed=3)),
        row(SamplingParams(temperature=0.0, logprobs=2)),
    ]
    out = SAMPLER(logits, rows)
    want = logits.float().argmax(dim=-1)
    assert out.token_ids[[0, 2, 3]].tolist() == want[[0, 2, 3]].tolist()


# --- penalties ------------------------------------------------------------------------------

VOCAB = 24
history = st.lists(st.integers(0, VOCAB - 1), max_size=12)
penalty_params = st.builds(
    SamplingParams,
    temperature=st.just(0.0),
    repetition_penalty=st.sampled_from([1.0, 0.5, 1.3, 2.0]),
    presence_penalty=st.floats(-2.0, 2.0),
    frequency_penalty=st.floats(-2.0, 2.0),
)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(penalty_params, history, history), min_size=1, max_size=4),
    st.integers(0, 2**31),
)
def test_penalties_match_reference(specs, key):
    rows = [row(p, prompt, output) for p, prompt, output in specs]
    logits = torch.stack([fixed_logits(key + i, VOCAB) for i in range(len(rows))])
    got = apply_penalties(logits.clone(), rows)
    want = torch.tensor([ref_penalties(logits[i].tolist(), r) for i, r in enumerate(rows)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    tokens = SAMPLER(logits, rows).token_ids
    for i, tok in enumerate(tokens.tolist()):
        assert want[i, tok] >= want[i].max() - 1e-5


def test_penalties_skip_rows_without_them():
    logits = fixed_logits(5, VOCAB)[None].repeat(2, 1)
    rows = [row(output=[1, 1, 2]), row(SamplingParams(frequency_penalty=1.0), output=[1, 1, 2])]
    got = apply_penalties(logits.clone(), rows)
    assert torch.equal(got[0], logits[0])
    assert got[1, 1] == logits[1, 1] - 2.0 and got[1, 2] == logits[1, 2] - 1.0


def dense_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The dense (B, V) formula, op for op, that the sparse implementation must equal bitwise."""
    x = logits.clone()
    vocab = x.shape[1]
    if not any(r.params.repetition_penalty != 1.0 for r in rows):
        rep = None
    else:
        rep = torch.tensor([[r.params.repetition_penalty] for r in rows])
    for i, r in enumerate(rows):
        if not r.params.uses_penalties:
            continue
        counts = torch.zeros(vocab).index_add_(
            0,
            torch.as_tensor(r.output_token_ids, dtype=torch.int64),
            torch.ones(len(r.output_token_ids)),
        )
        row = x[i]
        if rep is not None:
            seen = counts > 0
            seen[torch.as_tensor(r.prompt_token_ids, dtype=torch.int64)] = True
            row = torch.where(seen, torch.where(row > 0, row / rep[i], row * rep[i]), row)
        p = r.params
        x[i] = (
            row
            - torch.tensor(p.frequency_penalty) * counts
            - torch.tensor(p.presence_penalty) * (counts > 0)
        )
    return x


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([1.0, 0.7, 1.3]),
            st.sampled_from([0.0, 0.4, -1.1]),
            st.sampled_from([0.0, 0.3, -0.6]),
            st.lists(st.integers(0, 199), max_size=40),
            st.lists(st.integers(0, 199), max_size=40),
            st.booleans(),
        ),
        min_size=1,
        max_size=6,
    ),
    st.integers(0, 2**31),
    st.booleans(),
)
def test_sparse_penalties_equal_the_dense_formula_bitwise(specs, key, strided):
    """Rows with and without penalties, repeated ids, histories as lists or tensors, a
    non-contiguous logits view: the same float32 values as the dense formula, bit for bit."""
    rows = []
    for rep, presence, freq, prompt, output, as_tensor in specs:
        p = SamplingParams(
            temperature=0.0,
            repetition_penalty=rep,
            presence_penalty=presence,
            frequency_penalty=freq,
        )
        if as_tensor:
            prompt, output = _history(prompt), _history(output)
        rows.append(SamplingRow(p, prompt, output, None))
    g = make_generator(key)
    logits = torch.randn(len(rows), 200, generator=g) * 4
    want = dense_penalties(logits, rows)
    if strided:
        wide = torch.full((len(rows), 400), float("nan"))
        wide[:, ::2] = logits
        got = apply_penalties(wide[:, ::2], rows)
        assert torch.isnan(wide[:, 1::2]).all(), "wrote outside the view"
    else:
        got = apply_penalties(logits.clone(), rows)
    assert torch.equal(got, want)


def _history(ids) -> torch.Tensor:
    history = TokenHistory()
    history.extend(ids)
    return history.tensor


def test_token_history_mirrors_a_growing_list():
    history, ids, views = TokenHistory(), [], []
    for n in (0, 1, 63, 64, 65, 200, 200, 1000):
        new = list(range(len(ids), n))
        ids += new
        history.extend(new)
        view = history.tensor
        assert view.tolist() == ids and view.dtype == torch.int64
        views.append((view, list(ids)))
    for view, then in views:  # earlier views are never rewritten by later appends
        assert view.tolist() == then


# --- logit bias -----------------------------------------------------------------------------


def test_logit_bias_adds_exactly_and_only_to_its_rows_and_tokens():
    logits = torch.stack([fixed_logits(k, VOCAB) for k in range(3)])
    params = [
        SamplingParams(logit_bias={3: 2.5, 7: -1.0}),
        SamplingParams(),
        SamplingParams(logit_bias={0: 100.0}),
    ]
    got = apply_logit_bias(logits.clone(), params)
    want = logits.clone()
    want[0, 3] += 2.5
    want[0, 7] -= 1.0
    want[2, 0] += 100.0
    assert torch.equal(got, want)


def test_logit_bias_bans_and_forces_greedy_tokens_and_leaves_logprobs_raw():
    logits = fixed_logits(11, VOCAB)[None].repeat(2, 1)
    top = int(logits[0].argmax())
    forced = (top + 1) % VOCAB
    rows = [
        row(SamplingParams(temperature=0.0, logit_bias={top: -100.0}, logprobs=1)),
        row(SamplingParams(temperature=0.0, logit_bias={forced: 100.0})),
    ]
    out = SAMPLER(logits, rows)
    assert out.token_ids[0] != top and out.token_ids[1] == forced
    raw = torch.log_softmax(logits[0], dim=-1)
    assert out.top_token_ids[0, 0] == top  # logprobs are the raw model's, before the bias
    assert torch.allclose(out.top_logprobs[0, 0], raw[top])


def test_logit_bias_params_are_normalised_and_checked():
    p = SamplingParams(logit_bias={9: 1.0, 2: -3.0})
    assert p.logit_bias == ((2, -3.0), (9, 1.0)) and hash(p) == hash(
        SamplingParams(logit_bias={2: -3.0, 9: 1.0})
    )
    assert SamplingParams(logit_bias={}).logit_bias is None
    for bad in ({-1: 1.0}, {"5": 1.0}, {5: 100.5}):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
    with pytest.raises(ValueError, match="logit_bias"):
        apply_logit_bias(torch.zeros(1, VOCAB), [SamplingParams(logit_bias={VOCAB: 1.0})])


# --- seeding --------------------------------------------------------------------------------

SEED_VOCAB = 64
REQUESTS = {
    "a": SamplingParams(seed=1234, top_p=0.95, frequency_penalty=0.3),
    "b": SamplingParams(seed=99, temperature=0.8, top_k=20),
    "c": SamplingParams(temperature=1.2),
    "d": SamplingParams(temperature=0.0),
}


def run_batch(order: list[str], steps: int, default_seed: int) -> dict[str, list[int]]:
    """Decode ``steps`` tokens for requests in ``order``; logits depend on (request, step) only."""
    torch.manual_seed(default_seed)
    gens = {n: make_generator(p.seed) for n, p in REQUESTS.items() if p.seed is not None}
    outputs: dict[str, list[int]] = {n: [] for n in order}
    for step in range(steps):
        logits = torch.stack([fixed_logits(1000 * ord(n) + step, SEED_VOCAB, 1.0) for n in order])
        rows = [SamplingRow(REQUESTS[n], [1, 2, 3], list(outputs[n]), gens.get(n)) for n in order]
        for n, tok in zip(order, SAMPLER(logits, rows).token_ids.tolist(), strict=True):
            outputs[n].append(tok)
    return outputs


def test_seeded_rows_ignore_batch_composition():
    steps = 8
    alone_a = run_batch(["a"], steps, 0)["a"]
    alone_b = run_batch(["b"], steps, 1)["b"]
    for i, order in enumerate([["c", "a", "d"], ["b", "d", "c", "a"], ["a", "b"], ["d", "a"]]):
        got = run_batch(order, steps, 10 + i)
        assert got["a"] == alone_a, order
        if "b" in got:
            assert got["b"] == alone_b, order


def test_seeded_row_draws_exactly_once_per_step():
    gen = make_generator(7)
    rows = [SamplingRow(SamplingParams(seed=7), [], [], gen), row()]
    for _ in range(3):
        SAMPLER(torch.randn(2, 10), rows)
    ref = make_generator(7)
    for _ in range(3):
        torch.empty(10).exponential_(generator=ref)
    assert torch.equal(gen.get_state(), ref.get_state())


def test_different_seeds_differ():
    def decode(seed: int) -> list[int]:
        gen = make_generator(seed)
        params = SamplingParams(seed=seed)
        rows = [SamplingRow(params, [], [], gen)]
        return [SAMPLER(torch.zeros(1, SEED_VOCAB), rows).token_ids.item() for _ in range(10)]

    assert decode(1) == decode(1)
    assert decode(1) != decode(2)


# --- filters and distributions --------------------------------------------------------------

FILTERS = [
    SamplingParams(top_k=3),
    SamplingParams(top_p=0.6),
    SamplingParams(min_p=0.2),
    SamplingParams(temperature=0.7, top_k=5, top_p=0.8),
    SamplingParams(temperature=1.5, min_p=0.05, top_k=8, top_p=0.9),
    SamplingParams(top_k=100),
    SamplingParams(top_p=1e-9),
]


def short(p: SamplingParams) -> str:
    return ",".join(f"{k}={v}" for k, v in vars(p).items() if v != getattr(SamplingParams(), k))


@pytest.mark.parametrize("params", FILTERS, ids=short)
def test_filters_match_reference_mask(params):
    vocab = 30
    for key in range(20):
        scaled = fixed_logits(key, vocab) / params.temperature
        kept = torch.isfinite(apply_filters(scaled[None], [params])[0])
        allowed = ref_allowed(scaled.double().tolist(), params)
        assert set(kept.nonzero().flatten().tolist()) == allowed


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.builds(
            SamplingParams,
            temperature=st.sampled_from([0.6, 1.0, 1.7]),
            top_k=st.sampled_from([0, 0, 1, 4, 40, 299, 300, 1000]),
            top_p=st.sampled_from([1.0, 1.0, 0.3, 0.9, 0.99]),
            min_p=st.sampled_from([0.0, 0.0, 0.05]),
        ),
        min_size=1,
        max_size=6,
    ),
    st.integers(0, 2**31),
)
def test_filters_of_a_mixed_batch_match_each_rows_reference(params, key):
    """Rows with top-k only, top-p only, both or neither share one batch (the candidates are the
    largest k in use, or the whole vocabulary when a row has top-p alone); each row keeps its
    reference set."""
    vocab = 300
    scaled = torch.stack(
        [fixed_logits(key + i, vocab) / p.temperature for i, p in enumerate(params)]
    )
    kept = torch.isfinite(apply_filters(scaled.clone(), params))
    for i, p in enumerate(params):
        allowed = ref_allowed(scaled[i].double().tolist(), p)
        assert set(kept[i].nonzero().flatten().tolist()) == allowed, p


def test_top_k_keeps_ties_beyond_the_candidates():
    logits = torch.tensor([[5.0, 3.0, 3.0, 3.0, 1.0, 3.0]])
    kept = torch.isfinite(apply_filters(logits, [SamplingParams(top_k=2)]))
    assert kept.tolist() == [[True, True, True, True, False, True]]


def test_top_p_boundary_keeps_smallest_set():
    kept = apply_filters(torch.zeros(1, 4), [SamplingParams(top_p=0.5)])
    assert torch.isfinite(kept).sum() == 2  # cumulative 0.25, 0.5: two of four equal tokens


@pytest.mark.parametrize("params", FILTERS, ids=short)
def test_filtered_sampling_stays_in_set_and_matches_distribution(params):
    vocab, draws = 30, 20_000
    logits = fixed_logits(3, vocab, scale=1.5)
    torch.manual_seed(0)
    tokens = SAMPLER(logits[None].repeat(draws, 1), [row(params)] * draws).token_ids
    want = ref_distribution(logits, params)
    assert set(tokens.tolist()) <= set(want.nonzero().flatten().tolist())
    # NOTE: std of each frequency <= 0.0036 here; 0.02 is > 5 sigma and the seed is fixed.
    assert (frequencies(tokens, vocab) - want).abs().max() < 0.02


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_distribution_unseeded(temperature):
    vocab, draws = 5, 20_000
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0])
    torch.manual_seed(1)
    params = SamplingParams(temperature=temperature)
    tokens = SAMPLER(logits[None].repeat(draws, 1), [row(params)] * draws).token_ids
    want = torch.softmax(logits.double() / temperature, dim=-1)
    assert (frequencies(tokens, vocab) - want).abs().max() < 0.02


def test_temperature_distribution_seeded():
    vocab, draws, temperature = 5, 8_000, 0.8
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0])
    rows = [row(SamplingParams(temperature=temperature, seed=s)) for s in range(draws)]
    tokens = SAMPLER(logits[None].repeat(draws, 1), rows).token_ids
    want = torch.softmax(logits.double() / temperature, dim=-1)
    # NOTE: std of each frequency <= 0.0056 here; 0.03 is > 5 sigma and the seeds are fixed.
    assert (frequencies(tokens, vocab) - want).abs().max() < 0.03


# --- suppression ----------------------------------------------------------------------------


def test_suppressed_tokens_never_sampled():
    vocab, draws = 12, 4_000
    logits = torch.zeros(draws, vocab)
    logits[:, 4] = 20.0
    logits[:, 9] = 19.0
    torch.manual_seed(2)
    params = [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(seed=5)]
    rows = [row(params[i % 3], suppress=[4, 9]) for i in range(draws)]
    tokens = SAMPLER(logits, rows).token_ids
    assert not torch.isin(tokens, torch.tensor([4, 9])).any()
    assert tokens[0] == 0  # greedy: argmax after suppression, lowest index among ties


# --- logprobs -------------------------------------------------------------------------------


def test_logprobs_come_from_raw_logits():
    torch.manual_seed(3)
    raw = torch.randn(5, 40, dtype=torch.bfloat16) * 4
    rows = [
        row(SamplingParams(logprobs=3, temperature=0.5, repetition_penalty=1.5), [0, 1], [2]),
        row(SamplingParams(logprobs=None, top_k=2)),
        row(SamplingParams(logprobs=5, seed=1, frequency_penalty=2.0, top_p=0.5), [], [3, 3]),
        row(SamplingParams(logprobs=0, temperature=0.0, presence_penalty=-2.0), [], [7]),
        row(SamplingParams(logprobs=5, min_p=0.1), suppress=[int(raw[4].float().argmax())]),
    ]
    out = SAMPLER(raw, rows)
    ref = torch.log_softmax(raw.float(), dim=-1)
    top = ref.topk(5, dim=-1)
    assert out.top_logprobs.shape == (5, 5) and out.top_logprobs.dtype == torch.float32
    asked = [0, 2, 3, 4]
    torch.testing.assert_close(out.top_logprobs[asked], top.values[asked])
    assert torch.equal(out.top_token_ids[asked], top.indices[asked])
    want = ref.gather(1, out.token_ids[:, None]).squeeze(1)
    torch.testing.assert_close(out.sampled_logprobs[asked], want[asked])


def test_logprobs_zero_and_none():
    logits = torch.randn(2, 10)
    out = SAMPLER(logits, [row(SamplingParams(logprobs=0)), row()])
    assert out.top_logprobs.shape == (2, 0) and out.top_token_ids.shape == (2, 0)
    assert out.sampled_logprobs.shape == (2,)
    out = SAMPLER(logits, [row(SamplingParams(frequency_penalty=1.0), output=[1]), row()])
    assert out.sampled_logprobs is None and out.top_logprobs is None


# --- bad inputs -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("logits", "rows", "match"),
    [
        (torch.zeros(4), [row()], "2-D"),
        (torch.zeros(1, 2, 3), [row()], "2-D"),
        (torch.zeros(2, 5), [row()], "1 sampling rows for 2"),
        (torch.zeros(1, 5, dtype=torch.int64), [row()], "floating"),
        (torch.zeros(1, 5), [SamplingRow(SamplingParams(seed=1), [], [], None)], "generator"),
        (
            torch.zeros(1, 5),
            [SamplingRow(SamplingParams(), [], [], make_generator(1))],
            "generator",
        ),
        (torch.zeros(1, 5), [row(SamplingParams(presence_penalty=1.0), output=[5])], "outside"),
        (torch.zeros(1, 5), [row(SamplingParams(repetition_penalty=2.0), prompt=[-1])], "outside"),
        (torch.zeros(1, 5), [row(suppress=[7])], "outside"),
    ],
)
def test_bad_inputs_raise(logits, rows, match):
    with pytest.raises(ValueError, match=match):
        SAMPLER(logits, rows)
