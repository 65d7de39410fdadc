"""``/metrics`` passes Prometheus's own linter, ``promtool check metrics`` (``make test``
installs promtool; without it the test skips and says so)."""

from __future__ import annotations

import shutil
import subprocess

import httpx
import openai
import pytest

from tests.server_harness import MODEL_NAME, running_server, tiny_llm
from warmboot.server.engine_holder import EngineHolder

PROMTOOL = shutil.which("promtool")


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (make promtool)")
def test_metrics_pass_promtool(path):
    llm = tiny_llm(path, max_num_seqs=2)
    with running_server(EngineHolder.ready(llm.engine)) as url:
        # one request first, so the counters and histograms have samples
        api = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        api.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=3)
        text = httpx.get(url + "/metrics").text
    assert "warmboot_time_to_first_token_seconds_count 1.0" in text
    done = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
