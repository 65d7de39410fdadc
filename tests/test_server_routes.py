"""The routes beside completions and chat (``/v1/models/{id}``, ``/tokenize``,
``/detokenize``, ``/version``, ``/openapi.json``) and the inputs that used to get a 500, a
non-OpenAI error body or a silent misreading."""

from __future__ import annotations

import gzip
import json

import httpx
import pytest

from tests.server_harness import MODEL_NAME, running_server, tiny_llm
from warmboot import __version__
from warmboot.server.engine_holder import EngineHolder

KEY = "sk-test"


@pytest.fixture(scope="module")
def server(path):
    llm = tiny_llm(path, max_num_seqs=4)
    with running_server(EngineHolder.ready(llm.engine), api_key=KEY) as url:
        yield url, llm


def _post(url, path, body=None, content=None, headers=None, key=KEY):
    h = {"authorization": f"Bearer {key}", **(headers or {})}
    if body is not None:
        content, h = json.dumps(body).encode(), {"content-type": "application/json", **h}
    return httpx.post(url + path, content=content, headers=h, timeout=30)


def _error(resp, status: int) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    return error


def test_model_card_version_and_openapi(server):
    url, llm = server
    auth = {"authorization": f"Bearer {KEY}"}
    card = httpx.get(f"{url}/v1/models/{MODEL_NAME}", headers=auth).json()
    assert (
        card["id"] == MODEL_NAME and card["max_model_len"] == llm.engine.sched_config.max_model_len
    )
    assert _error(httpx.get(f"{url}/v1/models/other", headers=auth), 404)["param"] == "model"
    assert httpx.get(f"{url}/version").json() == {"version": __version__}
    spec = httpx.get(f"{url}/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize"} <= set(spec["paths"])


def test_tokenize_and_detokenize_round_trip(server):
    url, llm = server
    tok = llm.engine.tokenizer
    out = _post(url, "/tokenize", {"prompt": "hello there"}).json()
    assert out["tokens"] == tok.encode("hello there") and out["count"] == len(out["tokens"])
    chat = _post(url, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert chat["tokens"] == tok.encode(text, add_special_tokens=False)
    back = _post(url, "/detokenize", {"tokens": out["tokens"]}).json()
    assert back["prompt"] == tok.decode(out["tokens"], False)
    assert _error(_post(url, "/detokenize", {"tokens": [10**9]}), 400)["param"] == "tokens"
    assert _error(_post(url, "/tokenize", {}), 400)["param"] == "prompt"
    assert _post(url, "/tokenize", {"prompt": "x"}, key="wrong").status_code == 401


def test_bad_bodies_get_openai_errors(server):
    url, _ = server
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
    surrogate = b'{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 2}'
    assert "surrogate" in _error(_post(url, "/v1/completions", content=surrogate), 400)["message"]
    chat = b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udc00"}]}'
    _error(_post(url, "/v1/chat/completions", content=chat), 400)
    paired = json.dumps({**body, "prompt": "smile \U0001f600"}, ensure_ascii=True).encode()
    assert b"\\ud83d" in paired and _post(url, "/v1/completions", content=paired).status_code == 200
    latin = json.dumps(body).replace("hi", "h\xe9").encode("latin-1")
    assert "UTF-8" in _error(_post(url, "/v1/completions", content=latin), 400)["message"]
    zipped = gzip.compress(json.dumps(body).encode())
    gz = {"content-encoding": "gzip", "content-type": "application/json"}
    assert _post(url, "/v1/completions", content=zipped, headers=gz).status_code == 200
    _error(_post(url, "/v1/completions", content=b"\x1f\x8bnot gzip", headers=gz), 400)
    br = {"content-encoding": "br"}
    _error(_post(url, "/v1/completions", content=json.dumps(body).encode(), headers=br), 415)
    # curl -d sends no JSON content type
    plain = _post(url, "/v1/completions", content=json.dumps(body).encode())
    assert plain.status_code == 200, plain.text
    for prompt in ([[False]], [True, 1], [[1.5]]):
        error = _error(_post(url, "/v1/completions", {**body, "prompt": prompt}), 400)
        assert error["param"] == "prompt"


def test_auth_scheme_is_case_insensitive_and_405_names_the_methods(server):
    url, _ = server
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1}
    for scheme in ("bearer", "BEARER", "Bearer"):
        r = httpx.post(
            url + "/v1/completions", json=body, headers={"authorization": f"{scheme} {KEY}"}
        )
        assert r.status_code == 200, scheme
    r = httpx.get(url + "/v1/completions", headers={"authorization": f"Bearer {KEY}"})
    _error(r, 405)
    assert r.headers["allow"] == "POST"
