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


def _metrics(path) -> str:
    """``/metrics`` after one request (so the counters and histograms have samples)."""
    llm = tiny_llm(path, max_num_seqs=2)
    with running_server(EngineHolder.ready(llm.engine)) as url:
        api = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        api.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=3)
        return httpx.get(url + "/metrics").text


def _promtool(text: str) -> None:
    done = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (make promtool)")
def test_metrics_pass_promtool(path):
    text = _metrics(path)
    assert "warmboot_time_to_first_token_seconds_count 1.0" in text
    assert "warmboot_state_slots" not in text  # NOTE: no state layers
    _promtool(text)


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (make promtool)")
def test_a_hybrids_state_slots_are_metrics(tiny_model_dir):
    """State slots and kept states (``core.state_prefix``) of a model with state layers."""
    text = _metrics(tiny_model_dir("qwen3_5"))
    assert "warmboot_state_slots_capacity 6.0" in text  # NOTE: 2 * max_num_seqs + 2
    assert "warmboot_state_checkpoints_capacity 4.0" in text  # NOTE: 2 per seat
    assert "warmboot_state_prefix_hits_total 0.0" in text
    _promtool(text)
