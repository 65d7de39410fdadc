"""Ahead-of-time compile for sm_90 on the CPU and read the SASS (bench/sass_check.py).

Runs in a subprocess: the AOT compile needs real JIT functions, while the other Triton tests
define the kernels under the interpreter in this process."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # a Triton AOT compile in a subprocess


def _tools() -> bool:
    """ptxas and cuobjdump in Triton's wheel, found without importing triton here.

    NOTE: importing triton in this process before the other test modules set
    TRITON_INTERPRET would fix the interpreter knob off for them."""
    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:
        return False
    bin_dir = Path(spec.origin).parent / "backends" / "nvidia" / "bin"
    return all((bin_dir / t).is_file() for t in ("ptxas", "cuobjdump"))


@pytest.mark.skipif(not _tools(), reason="ptxas/cuobjdump not shipped with this Triton wheel")
def test_sm90_sass_emulated_exp2_has_no_mufu_or_conversions(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    out = tmp_path / "sass.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "sass_check.py"), "--json", str(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    kernels = json.loads(out.read_text())["kernels"]
    emu = kernels["exp2_emulated"]
    assert emu["MUFU.EX2"] == 0 and emu["F2I/FRND"] == 0
    assert kernels["fwd_d128_emu_all"]["MUFU.EX2"] < kernels["fwd_d128_emu0"]["MUFU.EX2"]
