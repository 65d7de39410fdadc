"""The GPU scripts run end to end on the CPU at tiny sizes, so a first GPU run is never spent
on a script that cannot work (device time is scarce: minutes per task)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_smoke_on_the_cpu(tmp_path):
    cmd = [sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--smoke"]
    done = subprocess.run(
        [*cmd, "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
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
