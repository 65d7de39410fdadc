"""The GPU scripts run end to end on the CPU at tiny sizes, so a first GPU run is never spent
on a script that cannot work (device time is scarce: minutes per task)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the GPU scripts' smoke runs on the CPU
ROOT = Path(__file__).resolve().parents[1]


def run_script(cmd: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    """The script in a child whose temporary files (models, stores) land under ``tmp_path``."""
    (tmp_path / "tmp").mkdir()
    env = dict(os.environ, TMPDIR=str(tmp_path / "tmp"))
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_gpu_check_smoke_on_the_cpu(tmp_path):
    cmd = [sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--smoke"]
    done = run_script([*cmd, "--out", str(tmp_path)], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads((tmp_path / "gpu_check.json").read_text())
    assert "errors" not in out, out.get("errors")
    for kind, counts in out["correctness"].items():
        of = counts.pop("of")
        assert of > 0 and all(n == of for n in counts.values()), (kind, counts)
    assert out["hidden_syncs"]["steps"] > 0
    assert len(out["bubble"]) == 4
    for row in out["bubble"]:
        assert row["sync_equals_pipelined"] and row["graphs_equal_eager"], row
        assert all(row[f"{n}_tok_s"] > 0 for n in ("sync_eager", "pipelined_graphs"))
    assert out["graphs_state"] == "emulated"
    assert all(r["graphs_graph_steps"] > 0 for r in out["decode_bf16"])


def test_attention_bench_smoke_in_the_interpreter(tmp_path):
    """Correctness at tiny sizes, then the speed parts' code (prefill against SDPA, decode
    against a copy) at tiny sizes in Triton's interpreter: the timings mean nothing here."""
    cmd = [sys.executable, "-m", "bench.attention", "--cpu", "--smoke", "--out", str(tmp_path)]
    done = run_script(cmd, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads((tmp_path / "attention_cpu.json").read_text())
    assert "errors" not in out, out.get("errors")
    assert out["correctness"] and not any(r["nan"] for r in out["correctness"])
    variants = ("triton", "triton_tau0", "triton_emu0", "triton_emu1/8", "triton_plain_order")
    for row in out["prefill_tflops"]:
        assert all(row[v] > 0 for v in variants), row
    assert [r["query_len"] for r in out["decode"]] == [1, 4]
    assert all(r["kernel_GBps"] > 0 and r["copy_GBps"] > 0 for r in out["decode"])


def test_quant_gemm_bench_smoke_in_the_interpreter(tmp_path):
    """The Triton quantized linear's GPU check at tiny sizes in the interpreter: every format
    close to the dequantized reference (bf16 rounding), the timing part's code run."""
    out_file = tmp_path / "gpu_quant.json"
    cmd = [sys.executable, "-m", "bench.gpu_quant", "--cpu", "--smoke", "--out", str(out_file)]
    done = run_script(cmd, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(out_file.read_text())
    assert "errors" not in out, out.get("errors")
    assert {r["fmt"] for r in out["correctness"]} == {"int8", "int4-g128", "fp8", "fp4-g32"}
    assert all(r["rel_err"] < 2e-2 for r in out["correctness"]), out["correctness"]
    assert all(r["fp4-g32_ms"] > 0 and r["bf16_ms"] > 0 for r in out["timing"])
