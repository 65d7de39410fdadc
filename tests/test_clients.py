"""The clients people use, from their own venv (``make test`` builds ``.venv-clients``):
LangChain's ``bind_tools``, its three ``with_structured_output`` methods and its Responses API
mode, LiteLLM's tools, the tool loops of the OpenAI Agents SDK and of LangGraph's ReAct agent
(a token limit that cuts the call included), and a schemathesis run over ``/openapi.json`` that
must find no 5xx."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.server_harness import MODEL_NAME, running_server, small_llama, tiny_llm
from warmboot.server.engine_holder import EngineHolder

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("WARMBOOT_CLIENTS_VENV", ROOT / ".venv-clients"))
HERE = Path(__file__).resolve().parent
needs_venv = pytest.mark.skipif(
    not (VENV / "bin/python").exists(), reason=f"client venv missing: {VENV} (make test builds it)"
)


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    model = small_llama(tmp_path_factory.mktemp("clients") / "model")
    llm = tiny_llm(model, max_num_seqs=4, max_model_len=1024)
    with running_server(EngineHolder.ready(llm.engine)) as url:
        yield url


def _run(script: str, url: str) -> dict:
    """Run ``tests/clients/SCRIPT`` in the client venv; its last line of output, as JSON."""
    env = dict(os.environ, OPENAI_API_KEY="unused", LITELLM_LOCAL_MODEL_COST_MAP="True")
    done = subprocess.run(
        [str(VENV / "bin/python"), str(HERE / "clients" / script), url, MODEL_NAME],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _weather_ok(args: dict) -> bool:
    return set(args) == {"city", "days"} and len(args["city"]) <= 12 and 1 <= args["days"] <= 7


@needs_venv
def test_langchain_and_litellm(url):
    out = _run("langchain_litellm.py", url)
    (call,) = out["bind_tools"]
    assert call["name"] == "Weather" and _weather_ok(call["args"])
    for method in ("function_calling", "json_schema"):
        assert out[method]["parsed"] is not None, out[method]
        assert _weather_ok(out[method]["parsed"])
    # json_mode promises JSON, not the schema: any JSON object is a correct answer
    assert isinstance(json.loads(out["json_mode"]["raw"]), dict), out["json_mode"]
    assert isinstance(out["responses_text"], str)
    (tool,) = out["litellm"]
    assert tool["name"] == "Weather" and _weather_ok(json.loads(tool["arguments"]))


# Tool-call markup of any format the server parses (hermes, Mistral, Llama 3.1), and a call's
# JSON head: none of it may reach a framework as text.
MARKUP = re.compile(
    r'</?tool_call>|\[TOOL_CALLS\]|<\|python_tag\|>|\{\s*"name"\s*:|"arguments"\s*:'
)


@pytest.fixture(scope="module")
def loops(url):
    """What the Agents SDK and LangGraph got, by framework and run (clients/agent_loops.py)."""
    return _run("agent_loops.py", url)


@needs_venv
@pytest.mark.parametrize("framework", ["agents", "langgraph"])
def test_agent_tool_loop_calls_the_tool(loops, framework):
    got = loops[framework]["complete"]
    ((name, args),) = got["wire"][0]["tool_calls"]
    assert name == "get_weather" and got["wire"][0]["finish_reason"] == "tool_calls", got
    assert got["final"] == f"sunny in {json.loads(args)['city']}", got


@needs_venv
@pytest.mark.parametrize("run", ["cut", "cut_stream", "cut_early", "cut_early_stream"])
@pytest.mark.parametrize("framework", ["agents", "langgraph"])
def test_agent_tool_loop_with_a_cut_call_gets_no_markup(loops, framework, run):
    """A call cut by max_tokens comes back as a tool call with the arguments so far (or, cut
    before its name, as nothing) and finish_reason "length", as OpenAI returns it: no call
    markup in any content, final answer or error the framework returns."""
    got = loops[framework][run]
    assert not any(MARKUP.search(text) for text in _texts(got)), got
    (reply,) = got["wire"]
    assert reply["finish_reason"] == "length" and not reply["content"], got
    if run.startswith("cut_early"):  # the name was not out yet: a length-limited empty reply
        assert not reply["tool_calls"] and _saw_length(framework, got), got
    else:
        assert [name for name, _ in reply["tool_calls"]] == ["get_weather"], got
        assert _saw_call(framework, got), got


def _texts(got):
    """Every string in a record, the wire's included."""
    if isinstance(got, str):
        yield got
    elif isinstance(got, dict | list):
        for value in got.values() if isinstance(got, dict) else got:
            yield from _texts(value)


def _saw_call(framework: str, got: dict) -> bool:
    if framework == "agents":
        return any(item["type"] == "tool_call_item" for item in got.get("items", []))
    first = got.get("messages", [{}])[0]
    return bool(first.get("tool_calls") or first.get("invalid_tool_calls"))


def _saw_length(framework: str, got: dict) -> bool:
    if framework == "agents":  # the SDK raises on a length-cut reply with nothing in it
        return "finish_reason='length'" in got.get("error", "")
    (message,) = got.get("messages", [{}])
    return message.get("finish_reason") == "length" and message.get("content") == ""


@pytest.fixture
def short_url(tmp_path_factory):
    """A server whose context is 128 tokens: a case that names no ``max_tokens`` generates at
    most that (with 1024, the run took 8 minutes of a loaded CI machine's 10-minute limit)."""
    model = small_llama(tmp_path_factory.mktemp("schemathesis") / "model")
    llm = tiny_llm(model, max_num_seqs=4, max_model_len=128)
    with running_server(EngineHolder.ready(llm.engine)) as url:
        yield url


@needs_venv
def test_schemathesis_finds_no_server_error(short_url, tmp_path):
    report = tmp_path / "report.json"
    options = {
        "--checks": "not_a_server_error",
        "--max-examples": "8",
        "--workers": "1",
        "--request-timeout": "60",
        "--report": "ndjson",
        "--report-ndjson-path": str(report),
    }
    cmd = [str(VENV / "bin/schemathesis"), "run", f"{short_url}/openapi.json"]
    cmd += [*(a for pair in options.items() for a in pair), "--generation-deterministic"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-4000:]
    counts = re.search(r"(\d+) generated, (\d+) passed", done.stdout)
    assert counts and counts.group(1) == counts.group(2), done.stdout[-2000:]
    assert int(counts.group(1)) > 200, "a real run: hundreds of cases over the 11 operations"
    tested = re.search(r"Tested: (\d+)", done.stdout)
    assert tested and int(tested.group(1)) >= 10, "every route of the OpenAPI document ran"
