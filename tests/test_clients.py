"""The clients people use, from their own venv (``make test`` builds ``.venv-clients``):
LangChain's ``bind_tools``, its three ``with_structured_output`` methods and its Responses API
mode, LiteLLM's tools, and a schemathesis run over ``/openapi.json`` that must find no 5xx."""

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
needs_venv = pytest.mark.skipif(not (VENV / "bin/python").exists(),
                                reason=f"client venv missing: {VENV} (make test builds it)")  # fmt: skip


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    model = small_llama(tmp_path_factory.mktemp("clients") / "model")
    llm = tiny_llm(model, max_num_seqs=4, max_model_len=1024)
    with running_server(EngineHolder.ready(llm.engine)) as url:
        yield url


def _weather_ok(args: dict) -> bool:
    return set(args) == {"city", "days"} and len(args["city"]) <= 12 and 1 <= args["days"] <= 7


@needs_venv
def test_langchain_and_litellm(url):
    env = dict(os.environ, OPENAI_API_KEY="unused", LITELLM_LOCAL_MODEL_COST_MAP="True")
    done = subprocess.run([str(VENV / "bin/python"), str(HERE / "clients/agents.py"), url,
                           MODEL_NAME], capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
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


@needs_venv
def test_schemathesis_finds_no_server_error(url, tmp_path):
    report = tmp_path / "report.json"
    cmd = [str(VENV / "bin/schemathesis"), "run", f"{url}/openapi.json",
           "--checks", "not_a_server_error", "--max-examples", "8", "--workers", "1",
           "--request-timeout", "60", "--generation-deterministic",
           "--report", "ndjson", "--report-ndjson-path", str(report)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-4000:]
    counts = re.search(r"(\d+) generated, (\d+) passed", done.stdout)
    assert counts and counts.group(1) == counts.group(2), done.stdout[-2000:]
    assert int(counts.group(1)) > 200, "a real run: hundreds of cases over the 11 operations"
    tested = re.search(r"Tested: (\d+)", done.stdout)
    assert tested and int(tested.group(1)) >= 10, "every route of the OpenAPI document ran"
