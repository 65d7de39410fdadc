"""Every request field honoured or refused, never silently ignored: through the openai SDK
(vLLM's fields in ``extra_body``), each honoured field is shown to change the output as vLLM
documents it, each refused one is a 400 naming it, an unknown one too."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.server_harness import MODEL_NAME, running_server, small_llama, tiny_llm
from warmboot.server.chat_render import chat_prompt
from warmboot.server.config import ServerConfig
from warmboot.server.engine_holder import EngineHolder
from warmboot.server.fields import UnsupportedParameter
from warmboot.server.protocol import ChatCompletionRequest

ASK = [{"role": "user", "content": "tell me about the weather"}]
GREETING = "{{ greeting }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = small_llama(tmp_path_factory.mktemp("fields") / "model")
    llm = tiny_llm(model, max_num_seqs=8, max_model_len=1024)
    with running_server(EngineHolder.ready(llm.engine), trust_request_chat_template=True) as url:
        yield url, llm


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def _chat(client, **kw):
    extra = kw.pop("extra_body", None)
    kw = dict(model=MODEL_NAME, messages=ASK, max_tokens=8, temperature=0) | kw
    return client.chat.completions.create(**kw, extra_body=extra)


def _complete(client, **kw):
    extra = kw.pop("extra_body", None)
    kw = dict(model=MODEL_NAME, prompt="the weather is", max_tokens=8, temperature=0) | kw
    return client.completions.create(**kw, extra_body=extra)


def _refused(call, param: str) -> str:
    with pytest.raises(openai.BadRequestError) as e:
        call()
    assert e.value.body["param"] == param, e.value.body
    return e.value.body["message"]


# -- unknown, refused and ignored fields ---------------------------------------------------------
@pytest.mark.parametrize("route", ["chat", "completions", "responses", "tokenize"])
def test_an_unknown_field_is_a_400_naming_it(server, route):
    url = server[0]
    body = {"model": MODEL_NAME, "frobnicate": 1}
    body |= {
        "chat": {"messages": ASK},
        "completions": {"prompt": "hi"},
        "responses": {"input": "hi"},
        "tokenize": {"prompt": "hi"},
    }[route]
    path = {
        "chat": "/v1/chat/completions",
        "completions": "/v1/completions",
        "responses": "/v1/responses",
        "tokenize": "/tokenize",
    }[route]
    r = httpx.post(url + path, json=body)
    assert r.status_code == 400
    assert (
        r.json()["error"]["param"] == "frobnicate" and "frobnicate" in r.json()["error"]["message"]
    )


def test_an_unknown_option_key_is_a_400_naming_its_path(client):
    msg = _refused(
        lambda: _chat(client, extra_body={"structured_outputs": {"jsn": {}}}),
        "structured_outputs.jsn",
    )
    assert "structured_outputs.jsn" in msg


@pytest.mark.parametrize(
    "field,value",
    [
        ("use_beam_search", True),
        ("length_penalty", 0.5),
        ("bad_words", ["a"]),
        ("functions", [{"name": "f"}]),
        ("audio", {"voice": "x"}),
        ("cache_salt", "s"),
        ("return_token_ids", True),
        ("echo", True),
        ("guided_decoding_backend", "outlines"),
    ],
)
def test_a_refused_field_is_a_400_naming_it(client, field, value):
    _refused(lambda: _chat(client, extra_body={field: value}), field)


def test_fields_ignored_by_design_change_nothing(client):
    plain = _chat(client).choices[0].message.content
    extra = {
        "user": "u1",
        "metadata": {"k": "v"},
        "store": True,
        "service_tier": "auto",
        "safety_identifier": "s",
        "prompt_cache_key": "p",
        "prediction": {"type": "content", "content": "x"},
    }
    assert _chat(client, extra_body=extra).choices[0].message.content == plain


# -- structured outputs: vLLM's forms ------------------------------------------------------------
CHOICES = ["sunny", "rain", "snow"]
SCHEMA = {
    "type": "object",
    "properties": {"t": {"enum": ["hot", "cold"]}},
    "required": ["t"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    "extra",
    [{"guided_choice": CHOICES}, {"structured_outputs": {"choice": CHOICES}}],
)
def test_choice_forms_pick_one_choice(client, extra):
    for seed in range(3):
        out = _chat(client, temperature=1.0, seed=seed, max_tokens=16, extra_body=extra)
        assert out.choices[0].message.content in CHOICES


@pytest.mark.parametrize(
    "extra", [{"guided_json": SCHEMA}, {"structured_outputs": {"json": SCHEMA}}]
)
def test_json_forms_follow_the_schema(client, extra):
    out = _complete(client, max_tokens=60, extra_body=extra).choices[0]
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), SCHEMA)


def test_regex_and_grammar_forms(client):
    out = _chat(client, max_tokens=12, extra_body={"guided_regex": "[a-c]{3}-[0-9]{2}"})
    assert re.fullmatch("[a-c]{3}-[0-9]{2}", out.choices[0].message.content)
    grammar = 'root ::= "yes" | "no"'
    out = _chat(client, extra_body={"structured_outputs": {"grammar": grammar}})
    assert out.choices[0].message.content in ("yes", "no")


def test_two_output_constraints_are_a_400(client):
    extra = {"guided_regex": "a+", "response_format": {"type": "json_object"}}
    msg = _refused(lambda: _chat(client, extra_body=extra), "response_format")
    assert "guided_regex" in msg


# -- rendering: continue_final_message, chat templates, their variables -------------------------
def test_continue_final_message_extends_the_last_message(server, client):
    url, llm = server
    opened = ASK + [{"role": "assistant", "content": "It is sunny and"}]
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    tok = httpx.post(url + "/tokenize", json={"messages": opened, **extra}).json()
    rendered = llm.get_tokenizer().decode(tok["tokens"], skip_special_tokens=False)
    assert rendered.endswith("It is sunny and"), "the final message is left open"
    chat = _chat(client, messages=opened, extra_body=extra).choices[0].message.content
    completed = _complete(client, prompt=tok["tokens"]).choices[0].text
    assert chat == completed
    _refused(
        lambda: _chat(client, messages=opened, extra_body={"continue_final_message": True}),
        "continue_final_message",
    )


def test_a_request_chat_template_and_its_kwargs(client):
    extra = {"chat_template": GREETING, "chat_template_kwargs": {"greeting": "hello there"}}
    out = _chat(client, extra_body=extra)
    plain = _chat(client, extra_body={"chat_template": GREETING})
    assert out.usage.prompt_tokens > plain.usage.prompt_tokens, "the kwarg was rendered"
    bad = {"chat_template_kwargs": {"enable_thinking": False}}
    msg = _refused(lambda: _chat(client, extra_body=bad), "chat_template_kwargs")
    assert "enable_thinking" in msg, "a variable the template never reads is not dropped"
    _refused(lambda: _chat(client, extra_body={"documents": [{"text": "d"}]}), "documents")
    _refused(lambda: _chat(client, reasoning_effort="low"), "reasoning_effort")


def test_a_request_chat_template_needs_the_server_to_trust_it(server):
    body = ChatCompletionRequest(model="m", messages=ASK, chat_template=GREETING)
    tokenizer = server[1].get_tokenizer()
    with pytest.raises(UnsupportedParameter) as e:
        chat_prompt(tokenizer, body, None, ServerConfig(served_model_name="m"))
    assert e.value.param == "chat_template" and "--trust-request-chat-template" in str(e.value)
    config = ServerConfig(served_model_name="m", chat_template=GREETING)
    plain = ChatCompletionRequest(model="m", messages=ASK)
    assert chat_prompt(tokenizer, plain, None, config)["prompt"].startswith("<user>")


# -- output shaping ------------------------------------------------------------------------------
def test_stop_strings_kept_with_include_stop_str_in_output(client):
    text = _complete(client, max_tokens=12).choices[0].text
    stop = text[3:6]
    assert stop.strip() and text.count(stop) >= 1
    cut = _complete(client, max_tokens=12, stop=[stop]).choices[0]
    kept = _complete(
        client, max_tokens=12, stop=[stop], extra_body={"include_stop_str_in_output": True}
    ).choices[0]
    assert kept.text == cut.text + stop and kept.finish_reason == "stop"


def test_special_tokens_kept_with_skip_special_tokens_false(server, client):
    special = server[1].get_tokenizer().token_to_id("<|im_start|>")
    kw = dict(max_tokens=3, logit_bias={str(special): 100})
    assert "<|im_start|>" not in _complete(client, **kw).choices[0].text
    shown = _complete(client, **kw, extra_body={"skip_special_tokens": False}).choices[0].text
    assert shown.startswith("<|im_start|>")


def test_tokens_as_token_ids(client):
    extra = {"return_tokens_as_token_ids": True}
    out = _complete(client, logprobs=2, extra_body=extra).choices[0].logprobs
    assert all(re.fullmatch(r"token_id:\d+", t) for t in out.tokens)
    assert all(re.fullmatch(r"token_id:\d+", t) for top in out.top_logprobs for t in top)
    chat = _chat(client, logprobs=True, top_logprobs=1, extra_body=extra)
    assert all(e.token.startswith("token_id:") for e in chat.choices[0].logprobs.content)


def test_truncate_prompt_tokens_keeps_the_last_tokens(server, client):
    tokens = httpx.post(server[0] + "/tokenize", json={"prompt": "a b c d e f g h i j"}).json()
    ids = tokens["tokens"]
    out = _complete(client, prompt="a b c d e f g h i j", extra_body={"truncate_prompt_tokens": 4})
    assert out.usage.prompt_tokens == 4
    assert out.choices[0].text == _complete(client, prompt=ids[-4:]).choices[0].text


def test_request_id_names_the_response_and_priority_is_accepted(client):
    out = _chat(client, extra_body={"request_id": "job-7", "priority": -1})
    assert out.id == "chatcmpl-job-7"


def test_tokenize_with_token_strings(server):
    got = httpx.post(
        server[0] + "/tokenize", json={"prompt": "sunny day", "return_token_strs": True}
    ).json()
    assert "".join(got["token_strs"]) == "sunny day" and len(got["token_strs"]) == got["count"]


# -- HTTP -------------------------------------------------------------------------------------
def test_head_probes_and_form_encoded_json(server):
    url = server[0]
    assert httpx.head(url + "/health").status_code == 200
    assert httpx.head(url + "/v1/models").status_code == 200
    body = json.dumps({"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2})
    form = {"content-type": "application/x-www-form-urlencoded"}  # what curl -d sends
    r = httpx.post(url + "/v1/completions", content=body, headers=form)
    assert r.status_code == 200, r.text


def test_continuous_usage_stats_in_every_chunk(client):
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(_chat(client, stream=True, stream_options=opts))
    counted = [c.usage.completion_tokens for c in chunks if c.choices and c.usage]
    assert counted and counted == sorted(counted), "usage so far, growing"
    assert chunks[-1].usage.completion_tokens == counted[-1] > 0
    texts = list(_complete(client, stream=True, stream_options=opts))
    assert all(t.usage is not None for t in texts)


def test_allowed_token_ids_restrict_sampling(server, client):
    allowed = httpx.post(server[0] + "/tokenize", json={"prompt": "sunny rain"}).json()["tokens"]
    extra = {"allowed_token_ids": allowed, "ignore_eos": True, "return_tokens_as_token_ids": True}
    for seed in range(2):
        out = _complete(client, temperature=1.0, seed=seed, logprobs=0, extra_body=extra)
        sampled = [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens]
        assert len(sampled) == 8 and set(sampled) <= set(allowed)
