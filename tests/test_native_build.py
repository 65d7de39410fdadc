"""The native kernels' build: keyed by what it is built from, and a missing compiler leaves
torch's kernels serving with the reason on record."""

from __future__ import annotations

import os
import subprocess
import sys

from warmboot.kernels import native


def test_the_key_follows_sources_and_compiler(tmp_path):
    src = tmp_path / "a.cpp"
    src.write_text("int f() { return 1; }\n")
    key = native.key("g++", [src])
    assert native.key("g++", [src]) == key
    src.write_text("int f() { return 2; }\n")
    assert native.key("g++", [src]) != key
    assert native.key("true", [src]) != native.key("g++", [src])  # NOTE: another compiler


def test_no_compiler_means_no_library_and_a_reason(tmp_path):
    env = {**os.environ, "CXX": "/nonexistent/g++", "WARMBOOT_CACHE": str(tmp_path)}
    code = (
        "from warmboot.kernels import native as n; print(n.library(), '|', n.unavailable_reason())"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "None | no C++ compiler (g++ or $CXX) on PATH"


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(native.ENV, "0")
    assert native.library() is None and native.unavailable_reason() == "$WARMBOOT_NATIVE=0"


def test_a_start_without_the_library_does_not_wait_for_its_build(tmp_path):
    """An empty cache: the attention backend serves at once (SDPA) while the library builds
    on its own thread, and takes the native kernels once it is there."""
    env = {**os.environ, "WARMBOOT_CACHE": str(tmp_path)}
    code = (
        "import time\n"
        "from warmboot.kernels import native\n"
        "from warmboot.kernels.torch_attention import TorchAttentionBackend\n"
        "t0 = time.perf_counter(); b = TorchAttentionBackend(); first = b.native\n"
        "waited = time.perf_counter() - t0\n"
        "while not native.ready() and time.perf_counter() - t0 < 300: time.sleep(0.2)\n"
        "print(first, round(waited, 2), b.native)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    first, waited, later = out.stdout.split()
    assert first == "False" and float(waited) < 2.0 and later == "True", out.stdout
