"""Grammar-constrained decoding: simulated sampling under xgrammar masks, bitmask kernels, errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from warmboot.device.grammar_backend import GrammarBackend
from warmboot.device.grammar_bitmask import _apply_bitmask_torch, allocate_bitmask, apply_bitmask
from warmboot.sampling_params import StructuredOutputs
from warmboot.tokenizer import Tokenizer
from warmboot.tokenizer.train import train_tokenizer

ROOT = Path(__file__).resolve().parents[1]
TOK_VOCAB = 512
EOS = 0
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "age", "color", "tags"],
}
REGEX = "[a-z]{3}-[0-9]{2}"
YES_NO = 'root ::= "yes" | "no"'


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("grammar-tok")
    train_tokenizer(path, TOK_VOCAB)
    return path


@pytest.fixture(scope="module")
def tokenizer(tok_dir) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


@pytest.fixture(scope="module", params=[TOK_VOCAB, 520], ids=["vocab512", "vocab520"])
def backend(request, tok_dir) -> GrammarBackend:
    return GrammarBackend(tok_dir / "tokenizer.json", request.param, [EOS])


def allowed_ids(bitmask: torch.Tensor, row: int, vocab: int) -> set[int]:
    bits = [(int(w) >> i) & 1 for w in bitmask[row].tolist() for i in range(32)]
    return {i for i in range(vocab) if bits[i]}


def sample_batch(backend, tokenizer, specs, seed, max_tokens=200) -> list[str | None]:
    """Decode a batch where row ``r`` follows ``specs[r]`` (None: unconstrained) with random
    logits; returns the text of each constrained row (which must have terminated).

    The logits favour tokens that close strings/objects (so JSON ends within ``max_tokens``) and
    strongly favour special and padding ids (so a mask letting them through would show).
    """
    vocab = backend.vocab_size
    gen = torch.Generator().manual_seed(seed)
    bias = torch.zeros(vocab)
    for i in range(TOK_VOCAB):
        piece = tokenizer.decode([i])
        if piece and set(piece) <= set('"}]'):
            bias[i] = 4.0 if '"' in piece else 2.0
    bias[1:3] = 10.0  # <|im_start|>, <|im_end|>
    bias[TOK_VOCAB:] = 10.0  # model-vocab padding
    matchers = {
        r: backend.matcher(backend.compile(s)) for r, s in enumerate(specs) if s is not None
    }
    out: dict[int, list[int]] = {r: [] for r in matchers}
    bitmask = allocate_bitmask(len(specs), vocab)
    for _ in range(max_tokens):
        rows = [r for r, m in matchers.items() if not m.is_terminated()]
        if not rows:
            break
        logits = torch.randn(len(specs), vocab, generator=gen) + bias
        for r in rows:
            matchers[r].fill_bitmask(bitmask, r)
        before = logits.clone()
        apply_bitmask(logits, bitmask, rows)
        for r in range(len(specs)):
            if r not in rows:
                assert torch.equal(logits[r], before[r])  # unmasked rows untouched
                continue
            allowed = allowed_ids(bitmask, r, vocab)
            assert allowed
            finite = set(torch.isfinite(logits[r]).nonzero().flatten().tolist())
            assert finite == allowed
            token = int(torch.multinomial(logits[r].softmax(-1), 1, generator=gen))
            assert token in allowed
            assert matchers[r].accept(token)
            out[r].append(token)
    texts: list[str | None] = [None] * len(specs)
    for r, m in matchers.items():
        assert m.is_terminated(), f"row {r} not done: {tokenizer.decode(out[r])!r}"
        assert out[r][-1] == EOS and EOS not in out[r][:-1]
        assert not set(out[r]) & {1, 2, *range(TOK_VOCAB, vocab)}
        texts[r] = tokenizer.decode(out[r])
    return texts


def check_schema(value, schema) -> None:
    """A validator for the subset of JSON schema used in SCHEMA."""
    if "enum" in schema:
        assert value in schema["enum"]
        return
    kind = schema["type"]
    if kind == "object":
        assert isinstance(value, dict)
        assert set(schema["required"]) <= set(value) <= set(schema["properties"])
        for key, item in value.items():
            check_schema(item, schema["properties"][key])
    elif kind == "array":
        assert isinstance(value, list) and len(value) <= schema.get("maxItems", len(value))
        for item in value:
            check_schema(item, schema["items"])
    elif kind == "string":
        assert isinstance(value, str)
        assert schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value))
    elif kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool)
        assert schema["minimum"] <= value <= schema["maximum"]


@pytest.mark.parametrize("seed", range(4))
def test_json_schema(backend, tokenizer, seed):
    specs = [StructuredOutputs(json=SCHEMA), None, StructuredOutputs(json=json.dumps(SCHEMA))]
    for text in sample_batch(backend, tokenizer, specs, seed):
        if text is not None:
            value = json.loads(text)
            check_schema(value, SCHEMA)
            assert list(value) == list(SCHEMA["properties"])  # schema order


def test_json_object(backend, tokenizer):
    specs = [None, StructuredOutputs(json_object=True), StructuredOutputs(json_object=True)]
    values = [
        json.loads(text)
        for seed in range(4)
        for text in sample_batch(backend, tokenizer, specs, seed)[1:]
    ]
    assert all(isinstance(v, dict) for v in values), values
    assert any(values), values  # not only {}


@pytest.mark.parametrize("seed", range(4))
def test_regex_and_grammar(backend, tokenizer, seed):
    specs = [StructuredOutputs(regex=REGEX), None, StructuredOutputs(grammar=YES_NO)]
    text, _, answer = sample_batch(backend, tokenizer, specs, seed)
    assert re.fullmatch(REGEX, text), text
    assert answer in ("yes", "no")


def test_special_and_padding_ids_never_allowed(backend, tokenizer):
    m = backend.matcher(backend.compile(StructuredOutputs(json_object=True)))
    for t in tokenizer.encode('{"a": "'):
        assert m.accept(t)
    bitmask = allocate_bitmask(1, backend.vocab_size)
    m.fill_bitmask(bitmask, 0)
    allowed = allowed_ids(bitmask, 0, backend.vocab_size)
    assert len(allowed) > 300  # almost any text fits in a string
    assert not allowed & {EOS, 1, 2, *range(TOK_VOCAB, backend.vocab_size)}
    for bad in (EOS, 1, 2, backend.vocab_size - 1, backend.vocab_size, -1, 10_000):
        if bad != backend.vocab_size - 1 or backend.vocab_size > TOK_VOCAB:
            assert not m.accept(bad)
    assert m.accept(tokenizer.encode('x"')[0])  # state unchanged by the rejections


def test_json_never_allows_raw_control_chars(backend, tokenizer):
    """xgrammar 0.2.8 allows them in length-bounded strings (issue #800); the backend does not."""
    control = {i for i in range(TOK_VOCAB) if any(ord(c) < 32 for c in tokenizer.decode([i]))}
    assert len(control) >= 30
    bitmask = allocate_bitmask(2, backend.vocab_size)
    for row, spec in enumerate([StructuredOutputs(json=SCHEMA), StructuredOutputs(regex=".*")]):
        m = backend.matcher(backend.compile(spec))
        for t in tokenizer.encode('{"name": "' if row == 0 else "a"):
            assert m.accept(t)
        m.fill_bitmask(bitmask, row)
    assert not allowed_ids(bitmask, 0, backend.vocab_size) & control
    assert allowed_ids(bitmask, 1, backend.vocab_size) & control  # only JSON bans them


def test_termination(backend, tokenizer):
    m = backend.matcher(backend.compile(StructuredOutputs(grammar=YES_NO)))
    assert not m.accept(tokenizer.encode("maybe")[0])
    assert not m.accept(EOS)  # the grammar is not complete yet
    for t in tokenizer.encode("yes"):
        assert m.accept(t)
    assert not m.is_terminated()
    bitmask = allocate_bitmask(2, backend.vocab_size)
    m.fill_bitmask(bitmask, 1)
    assert allowed_ids(bitmask, 1, backend.vocab_size) == {EOS}
    assert allowed_ids(bitmask, 0, backend.vocab_size) == set(range(backend.vocab_size))
    assert m.accept(EOS) and m.is_terminated()
    assert not m.accept(EOS) and not m.accept(tokenizer.encode("a")[0])
    bitmask.fill_(-1)
    m.fill_bitmask(bitmask, 0)
    assert allowed_ids(bitmask, 0, backend.vocab_size) == {EOS}


def test_matchers_are_independent(backend, tokenizer):
    compiled = backend.compile(StructuredOutputs(grammar=YES_NO))
    a, b = backend.matcher(compiled), backend.matcher(compiled)
    for t in tokenizer.encode("yes"):
        assert a.accept(t)
    assert a.accept(EOS) and a.is_terminated() and not b.is_terminated()
    for t in tokenizer.encode("no"):
        assert b.accept(t)
    assert b.accept(EOS) and b.is_terminated()


def test_compile_cache(backend):
    spec = StructuredOutputs(json=SCHEMA)
    compiled = backend.compile(spec)
    assert backend.compile(StructuredOutputs(json=dict(SCHEMA))) is compiled
    assert backend.compile(StructuredOutputs(json=json.dumps(SCHEMA, indent=2))) is compiled
    regex = backend.compile(StructuredOutputs(regex=REGEX))
    assert backend.compile(StructuredOutputs(regex=REGEX)) is regex
    assert backend.compile(StructuredOutputs(grammar=YES_NO)) is not regex
    obj = backend.compile(StructuredOutputs(json_object=True))
    assert backend.compile(StructuredOutputs(json_object=True)) is obj


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (StructuredOutputs(json={"type": "nope"}), ["structured_outputs.json", "nope"]),
        (StructuredOutputs(json="{not json"), ["structured_outputs.json", "not valid JSON"]),
        (StructuredOutputs(json="[1, 2]"), ["structured_outputs.json", "object or bool"]),
        (
            StructuredOutputs(json={"type": "integer", "minimum": 5, "maximum": 2}),
            ["minimum greater than maximum"],
        ),
        (StructuredOutputs(regex="[a-z"), ["structured_outputs.regex", "Unclosed '['"]),
        (StructuredOutputs(grammar='root ::= "yes'), ["structured_outputs.grammar", "line 1"]),
        (StructuredOutputs(grammar='start ::= "a"'), ["structured_outputs.grammar", '"root"']),
        (StructuredOutputs(grammar="root ::= foo"), ['"foo" is not defined']),
    ],
)
def test_invalid_specs(backend, spec, words):
    with pytest.raises(ValueError) as info:
        backend.compile(spec)
    message = str(info.value)
    assert all(w in message for w in words), message
    assert ".cc:" not in message  # no C++ log prefix


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_apply_bitmask_matches_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    vocab, batch, rows = 100, 5, [3, 0, 2]
    bitmask = torch.randint(-(2**31), 2**31 - 1, (batch, 4), generator=gen, dtype=torch.int32)
    logits = torch.randn(batch, vocab, generator=gen).to(dtype)
    expected = logits.clone()
    for r in rows:
        for j in range(vocab):
            if not (int(bitmask[r, j // 32]) >> (j % 32)) & 1:
                expected[r, j] = float("-inf")
    cpu = logits.clone()
    apply_bitmask(cpu, bitmask, rows)
    assert torch.equal(cpu, expected)
    ref = logits.clone()
    _apply_bitmask_torch(ref, bitmask, rows, vocab)  # the non-CPU path, run on CPU
    assert torch.equal(ref, expected)
    untouched = logits.clone()
    apply_bitmask(untouched, bitmask, [])
    assert torch.equal(untouched, logits)
    with pytest.raises(IndexError):
        apply_bitmask(logits, bitmask, [batch])


def test_allocate_bitmask():
    bitmask = allocate_bitmask(3, 520)
    assert bitmask.shape == (3, 17) and bitmask.dtype == torch.int32
    assert bitmask.device.type == "cpu" and bool((bitmask == -1).all())


def test_no_transformers_import(tok_dir):
    """xgrammar loads without transformers, and transformers still imports fine afterwards."""
    code = (
        "import sys\n"
        "from warmboot.device.grammar_backend import GrammarBackend\n"
        f"GrammarBackend({str(tok_dir / 'tokenizer.json')!r}, 512, [0])\n"
        "assert 'xgrammar' in sys.modules and 'transformers' not in sys.modules\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "assert PreTrainedTokenizerFast.__module__.startswith('transformers.')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


def test_batched_fill_equals_per_row_fills(backend, tokenizer):
    """``fill_bitmasks`` (one call, xgrammar's threads) writes exactly what per-row fills
    write, for matchers in every state, at any rows; other rows stay untouched."""
    cases = [
        (StructuredOutputs(json=SCHEMA), '{"name": "'),
        (StructuredOutputs(regex=REGEX), "ab"),
        (StructuredOutputs(grammar=YES_NO), "yes"),  # complete: only EOS
        (StructuredOutputs(grammar=YES_NO), None),  # terminated: only EOS
        (StructuredOutputs(json_object=True), ""),
    ]
    matchers = []
    for spec, prefix in cases:
        m = backend.matcher(backend.compile(spec))
        for t in tokenizer.encode(prefix if prefix is not None else "no"):
            assert m.accept(t)
        if prefix is None:
            assert m.accept(EOS) and m.terminated
        matchers.append(m)
    rows = [6, 0, 3, 4, 1]
    words = (backend.vocab_size + 31) // 32
    batched = torch.full((8, words), 12345, dtype=torch.int32)
    backend.fill_bitmasks(matchers, batched, rows)
    one_by_one = torch.full((8, words), 12345, dtype=torch.int32)
    for m, r in zip(matchers, rows, strict=True):
        m.fill_bitmask(one_by_one, r)
    assert torch.equal(batched, one_by_one)
    assert (batched[[2, 5, 7]] == 12345).all()
    assert allowed_ids(batched, 3, backend.vocab_size) == {EOS}
    assert allowed_ids(batched, 4, backend.vocab_size) == {EOS}


def test_batched_accept_equals_one_by_one(backend, tokenizer):
    """``accept_tokens`` (one call into xgrammar) gives the answers and states of accepting
    token by token: allowed, disallowed, out of the vocabulary, EOS that terminates."""
    specs = [
        StructuredOutputs(grammar=YES_NO),
        StructuredOutputs(regex=REGEX),
        StructuredOutputs(json=SCHEMA),
        StructuredOutputs(grammar=YES_NO),
    ]
    prefixes = ["yes", "ab", '{"name": "', "n"]
    streams = [
        [EOS, tokenizer.encode("x")[0]],  # "yes" complete: EOS terminates, then nothing fits
        [tokenizer.encode("c")[0], tokenizer.encode("9")[0]],
        [10_000, tokenizer.encode("a")[0]],
        [tokenizer.encode("o")[0], EOS],
    ]

    def matchers():
        ms = [backend.matcher(backend.compile(s)) for s in specs]
        for m, prefix in zip(ms, prefixes, strict=True):
            for t in tokenizer.encode(prefix):
                assert m.accept(t)
        return ms

    batched, single = matchers(), matchers()
    for k in range(2):
        got = backend.accept_tokens([(m, s[k]) for m, s in zip(batched, streams, strict=True)])
        want = [m.accept(s[k]) for m, s in zip(single, streams, strict=True)]
        assert got == want
        assert [m.terminated for m in batched] == [m.terminated for m in single]
    assert batched[0].terminated and batched[3].terminated and not batched[1].terminated
    assert got[0] is False  # nothing after termination


def test_requests_end_on_a_rejected_token_or_termination(tok_dir, tokenizer, caplog):
    """The engine side: a token the grammar refuses (impossible with the mask applied) ends
    its request with an error in the log; so does an accepted EOS; the others go on."""
    from warmboot.core.types import TokenEvent
    from warmboot.device.grammar_requests import GrammarRequests

    grammars = GrammarRequests(tok_dir / "tokenizer.json", TOK_VOCAB, (EOS,))
    for rid, spec in (("bad", REGEX), ("done", None), ("fine", REGEX)):
        grammars.add(
            rid,
            StructuredOutputs(grammar=YES_NO) if spec is None else StructuredOutputs(regex=spec),
        )

    def event(rid, text=None, token=None):
        ids = tokenizer.encode(text) if text is not None else [token]
        return TokenEvent(rid, ids, [None] * len(ids))

    assert grammars.accept([event("bad", "ab"), event("done", "yes"), event("fine", "ab")]) == []
    ended = grammars.accept(
        [event("bad", token=tokenizer.encode("7")[0]), event("done", token=EOS), event("fine", "c")]
    )
    assert ended == ["bad", "done"]
    assert "bad: token" in caplog.text and "violates its grammar" in caplog.text
