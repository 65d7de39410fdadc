"""Tokenizer wrapper vs ``transformers``, incremental detokenization, and tokenizer training."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from warmboot.tokenizer import ByteLevelDetokenizer, IncrementalDetokenizer, Tokenizer
from warmboot.tokenizer.train import CHAT_TEMPLATE, train_tokenizer

ROOT = Path(__file__).resolve().parents[1]
TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "Line one\nLine two\n\n\ttabbed",
    "Numbers: 3.14159, 2024-03-15, $1,450 and 42%.",
    "café naïve façade résumé crème brûlée",
    "東京 日本語 Москва Ελλάδα",
    "Emoji 🙂🚀 🍜🌍 mixed with text",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "supercalifragilisticexpialidocious zxqvjk brolutaim",
    "",
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2? Réponds en français 🙂"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "東京?"},
]
RICH_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(n=0) %}"
    "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
    "{% if loop.index > 3 %}{% break %}{% endif %}{% set ns.n = ns.n + 1 %}"
    "[{{ m['role'] | upper }}] {{ m['content'] | tojson }}\n"
    "{% endfor %}{% if tools %}TOOLS {{ tools | tojson }}{% endif %}"
    "n={{ ns.n }}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}{{ eos_token }}"
)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok512")
    train_tokenizer(path, 512)
    return path


@pytest.fixture(scope="module")
def big_tok_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok49152")
    train_tokenizer(path, 49152)
    return path


def _hf(path: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("which", ["tok_dir", "big_tok_dir"])
def test_matches_transformers(which, request):
    path = request.getfixturevalue(which)
    ours, hf = Tokenizer.from_dir(path), _hf(path)
    assert ours.vocab_size == len(hf) == len(ours)
    assert (ours.eos_token_id, ours.bos_token_id) == (hf.eos_token_id, hf.bos_token_id) == (0, 0)
    assert ours.all_special_ids == frozenset(hf.all_special_ids) == {0, 1, 2}
    for text in TEXTS:
        for add in (True, False):
            ids = ours.encode(text, add_special_tokens=add)
            assert ids == hf.encode(text, add_special_tokens=add), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            )
    assert ours.decode(ours.encode(TEXTS[6]), skip_special_tokens=False) == TEXTS[6]


def test_chat_template_matches_transformers(tok_dir):
    ours, hf = Tokenizer.from_dir(tok_dir), _hf(tok_dir)
    assert ours.chat_template == CHAT_TEMPLATE
    for gen in (True, False):
        for msgs in (MESSAGES, MESSAGES[1:2]):
            expected = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(msgs, add_generation_prompt=gen) == expected
    rendered = ours.apply_chat_template(MESSAGES[:2])
    assert rendered.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n")
    assert rendered.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_rich_template_matches_transformers(tok_dir, tmp_path):
    shutil.copyfile(tok_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = RICH_TEMPLATE
    config["eos_token"] = {"__type": "AddedToken", "content": "<|im_end|>", "special": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours, hf = Tokenizer.from_dir(tmp_path), _hf(tmp_path)
    assert ours.eos_token_id == hf.eos_token_id == 2
    tools = [{"name": "f", "description": "é <b>"}]
    for kwargs in ({}, {"tools": tools}):
        expected = hf.apply_chat_template(MESSAGES, tokenize=False, **kwargs)
        assert ours.apply_chat_template(MESSAGES, add_generation_prompt=False, **kwargs) == expected
    with pytest.raises(Exception, match="no tools"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_template_from_jinja_file_and_strftime(tok_dir, tmp_path):
    shutil.copyfile(tok_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "chat_template.jinja").write_text("{{ strftime_now('%Y') }}|{{ x }}")
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.apply_chat_template([], x=7).split("|")[1] == "7"
    assert tok.apply_chat_template([]).split("|")[0].isdigit()


def test_missing_files(tok_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    shutil.copyfile(tok_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.eos_token_id is None and tok.bos_token_id is None and tok.chat_template is None
    assert tok.all_special_ids == {0, 1, 2}
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template(MESSAGES)


def _stream(tok: Tokenizer, ids: list[int], skip: bool) -> list[str]:
    detok = tok.detokenizer(skip_special_tokens=skip)
    return [detok.step(i) for i in ids]


def _byte_to_char() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by ByteLevel vocabularies."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    rest = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(rest)}}


def _random_split_ids(tok: Tokenizer, rng: random.Random) -> list[int]:
    """Ids of random multi-byte text, cut at random byte offsets (often inside a character)."""
    pool = "ab cd.é東京🙂🦜ñ\nЖ"
    data = "".join(rng.choice(pool) for _ in range(rng.randint(1, 20))).encode()
    table, ids, pos = _byte_to_char(), [], 0
    while pos < len(data):
        end = min(len(data), pos + rng.randint(1, 4))
        tid = tok.token_to_id("".join(table[b] for b in data[pos:end]))
        if tid is None:
            end, tid = pos + 1, tok.token_to_id(table[data[pos]])
        ids.append(tid)
        pos = end
        if rng.random() < 0.05:
            ids.append(rng.randrange(3))
    return ids


@pytest.mark.parametrize("which", ["tok_dir", "big_tok_dir"])
def test_detokenizer_random_ids(which, request):
    tok = Tokenizer.from_dir(request.getfixturevalue(which))
    rng = random.Random(0)
    checked = 0
    for trial in range(600):
        if trial % 2:
            ids = _random_split_ids(tok, rng)
        else:
            ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 40))]
        for skip in (True, False):
            full = tok.decode(ids, skip_special_tokens=skip)
            if "\ufffd" in full:
                continue
            assert "".join(_stream(tok, ids, skip)) == full, ids
            checked += 1
    assert checked > 400


def _whole(detok, ids: list[int]) -> str:
    return "".join(detok.step(i) for i in ids) + detok.flush()


@pytest.mark.parametrize("which", ["tok_dir", "big_tok_dir"])
def test_byte_level_detokenizer_equals_decode_on_any_ids(which, request):
    """The table path is taken for a ByteLevel vocabulary, and its pieces plus the flush equal
    ``decode`` and the ``DecodeStream`` path on any ids: cut characters, invalid UTF-8 (U+FFFD),
    special tokens either way, ids past the vocabulary."""
    tok = Tokenizer.from_dir(request.getfixturevalue(which))
    assert isinstance(tok.detokenizer(), ByteLevelDetokenizer)
    rng = random.Random(1)
    invalid = 0
    for trial in range(600):
        if trial % 2:
            ids = _random_split_ids(tok, rng)
            ids = ids[: rng.randint(1, len(ids))]  # often ends inside a character
        else:
            ids = [rng.randrange(tok.vocab_size + 8) for _ in range(rng.randint(1, 40))]
        for skip in (True, False):
            full = tok.decode(ids, skip_special_tokens=skip)
            invalid += "\ufffd" in full
            assert _whole(tok.detokenizer(skip), ids) == full, (ids, skip)
            assert _whole(IncrementalDetokenizer(tok._tok, skip), ids) == full, (ids, skip)
    assert invalid > 100, "the trials must include invalid UTF-8"


def test_token_text_is_the_single_token_decode(tok_dir):
    tok = Tokenizer.from_dir(tok_dir)
    for i in [*range(tok.vocab_size), tok.vocab_size + 3, 0, 5]:  # twice: from the cache
        assert tok.token_text(i) == tok.decode([i], skip_special_tokens=False)


def test_other_decoders_keep_decode_stream(tmp_path):
    """A vocabulary whose decoder is not ByteLevel alone (here SentencePiece-style Metaspace)
    goes through ``DecodeStream``."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    hf = HFTokenizer(models.WordLevel({"\u2581hi": 0, "\u2581there": 1, "[UNK]": 2}, "[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Metaspace()
    hf.decoder = decoders.Metaspace()
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_dir(tmp_path)
    detok = tok.detokenizer()
    assert isinstance(detok, IncrementalDetokenizer)
    assert _whole(detok, [0, 1]) == tok.decode([0, 1]) == "hi there"


@pytest.mark.parametrize("which", ["tok_dir", "big_tok_dir"])
def test_detokenizer_multibyte_text(which, request):
    tok = Tokenizer.from_dir(request.getfixturevalue(which))
    saw_pending = False
    for text in TEXTS + ["🦜", "a🦜b東京c", "🍜🍜🍜 naïve 東京 🌍🦜"]:
        ids = tok.encode(text)
        for skip in (True, False):
            pieces = _stream(tok, ids, skip)
            assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
            assert all("\ufffd" not in p for p in pieces)
            saw_pending |= "" in pieces and "🦜" in text
    assert saw_pending


@pytest.mark.parametrize("which", ["tok_dir", "big_tok_dir"])
def test_token_bytes_rebuild_the_text(which, request):
    """Each token's own bytes (what chat logprobs report) concatenate to the UTF-8 text, even
    where single tokens hold part of a character and decode to U+FFFD on their own."""
    tok = Tokenizer.from_dir(request.getfixturevalue(which))
    split_char = False
    for text in TEXTS + ["🦜", "a🦜b東京c", "🍜🍜🍜 naïve 東京 🌍🦜"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")
        split_char |= any("\ufffd" in tok.decode([i]) for i in ids)
    assert split_char, "the texts must include characters split across tokens"
    assert tok.token_bytes(tok.vocab_size + 5) == b""


@pytest.mark.parametrize("size", [259, 300, 384, 512, 1000, 4000, 49152])
def test_exact_vocab_size(size, tmp_path, request):
    if size == 49152:
        path = request.getfixturevalue("big_tok_dir")
    else:
        train_tokenizer(tmp_path, size)
        path = tmp_path
    data = json.loads((path / "tokenizer.json").read_text())
    assert len(data["model"]["vocab"]) == size
    assert Tokenizer.from_dir(path).vocab_size == size
    assert [t["content"] for t in data["added_tokens"]][:3] == [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
    ]
    assert [t["id"] for t in data["added_tokens"]] == [0, 1, 2]


def test_too_small_vocab(tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(tmp_path, 100)


def test_deterministic(big_tok_dir, tmp_path):
    train_tokenizer(tmp_path / "a", 512)
    train_tokenizer(tmp_path / "b", 512)
    assert (tmp_path / "a/tokenizer.json").read_bytes() == (
        tmp_path / "b/tokenizer.json"
    ).read_bytes()
    code = (
        "import sys; from pathlib import Path; from warmboot.tokenizer.train import train_tokenizer;"
        "train_tokenizer(Path(sys.argv[1]), 49152)"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "c")], cwd=ROOT, check=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "c" / name).read_bytes() == (big_tok_dir / name).read_bytes()


def test_import_does_not_load_transformers():
    code = "import sys, warmboot.tokenizer; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
