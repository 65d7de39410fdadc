"""A large response body is encoded in small pieces (each C ``json.dumps`` call holds the GIL:
a 26 MB echo body held the event loop for 0.8 s), and the pieces join to exactly what one
``json.dumps`` call writes."""

from __future__ import annotations

import json
import random

import pytest

from warmboot.server import delivery


def _plain(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _echo_body(choices: int, positions: int) -> dict:
    """The shape of an echoed completion with prompt logprobs (vLLM's format) and n > 1."""
    rng = random.Random(0)
    prompt_lps = [None] + [
        {
            str(t): {"logprob": -rng.random(), "rank": r, "decoded_token": f"t\u00e9{t}"}
            for r, t in enumerate(rng.sample(range(50000), 21))
        }
        for _ in range(positions - 1)
    ]
    choice = {
        "text": "é" * positions,
        "index": 0,
        "logprobs": None,
        "finish_reason": "length",
        "prompt_logprobs": prompt_lps,
    }
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "choices": [choice] * choices,
        "usage": {"prompt_tokens": positions, "completion_tokens": choices},
    }


@pytest.mark.parametrize(
    "obj",
    [
        {},
        [],
        None,
        "ü \u2028 \x00",
        {3: "int key", 2.5: "float key", True: "bool key", None: "none key", "s": (1, 2)},
        {"deep": [[[[[[[[[[{"x": [1.5, -0.0, 1e300]}]]]]]]]]]]},
        {"long": list(range(1000)), "dicts": [{"a": i, "b": [i] * 3} for i in range(300)]},
        [[], {}, [{}], {"e": []}, ""],
    ],
)
def test_pieces_join_to_json_dumps(obj):
    assert "".join(delivery.json_pieces(obj)) == _plain(obj)


@pytest.fixture
def encoded(monkeypatch) -> list[int]:
    """The length of what each ``json.dumps`` call of ``json_pieces`` writes."""
    sizes: list[int] = []

    def recording(obj) -> str:
        out = _plain(obj)
        sizes.append(len(out))
        return out

    monkeypatch.setattr(delivery, "_dumps", recording)
    return sizes


def test_an_echo_body_joins_exactly_and_no_piece_is_large(encoded):
    body = _echo_body(choices=8, positions=400)
    sizes = encoded
    joined = "".join(delivery.json_pieces(body))
    assert joined == _plain(body)
    assert max(sizes) < len(joined) / 40, (max(sizes), len(joined))


def test_nan_is_refused_as_json_dumps_refuses_it():
    with pytest.raises(ValueError):
        "".join(delivery.json_pieces({"x": [1.0] * 100 + [float("nan")]}))
    with pytest.raises(TypeError):
        "".join(delivery.json_pieces({"x": object()}))


def test_a_long_list_the_choices_share_is_encoded_once(encoded):
    """``n`` choices share their prompt's logprobs (one list object): 8 choices cost about
    one encoding, and a list equal to it but not the same object is encoded on its own."""
    body = _echo_body(choices=8, positions=400)
    joined = "".join(delivery.json_pieces(body))
    assert joined == _plain(body)
    assert sum(encoded) < len(joined) / 6, (sum(encoded), len(joined))
    copies = {"a": list(range(500)), "b": list(range(500))}
    copies["b"][-1] = -1  # NOTE: equal lengths, other content: no sharing by value
    assert "".join(delivery.json_pieces(copies)) == _plain(copies)
