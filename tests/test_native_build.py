"""The native kernels' build: keyed by what it is built from, and a missing compiler leaves
torch's kernels serving with the reason on record."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from warmboot.kernels import native


def test_the_keys_follow_sources_and_compiler(tmp_path):
    src = tmp_path / "a.cpp"
    src.write_text("int f() { return 1; }\n")
    key = native.load_key([src])
    assert native.load_key([src]) == key
    src.write_text("int f() { return 2; }\n")
    assert native.load_key([src]) != key
    assert native.build_key("true") != native.build_key("g++")  # NOTE: another compiler


def test_loading_a_built_library_does_not_import_the_extension_builder():
    """The link flags (in the build key) name torch's lib dir as ``cpp_extension`` does, and a
    load of the built library imports neither it nor setuptools (0.1 s and 11 MB a boot)."""
    from torch.utils.cpp_extension import library_paths

    assert f"-L{library_paths()[0]}" in native._link_flags()
    if native.library() is None:  # NOTE: built here, if need be, for the child to load
        pytest.skip(f"native kernels unavailable: {native.unavailable_reason()}")
    code = (
        "import sys; from warmboot.kernels import native as n; n.library()\n"
        "print(sorted({'setuptools', 'torch.utils.cpp_extension'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr[-2000:]


def _adopt_in(cache, blob: bytes, keys) -> str:
    code = (
        "import sys; from warmboot.kernels import native as n\n"
        f"print(n.adopt(sys.stdin.buffer.read(), {keys!r})); print(n.library(), '|', n.isa())"
    )
    env = {**os.environ, "CXX": "/nonexistent/g++", "WARMBOOT_CACHE": str(cache)}
    out = subprocess.run([sys.executable, "-c", code], env=env, input=blob, capture_output=True)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    return out.stdout.decode()


def test_a_carried_library_loads_without_a_compiler(tmp_path):
    """What a snapshot carries (``carried``/``adopt``): placed under its keys in an empty
    cache and loaded there with no compiler; refused when its keys are malformed or its load
    key is not this host's."""
    if native.library() is None:
        pytest.skip(f"native kernels unavailable: {native.unavailable_reason()}")
    blob, keys = native.carried()
    placed = _adopt_in(tmp_path / "a", blob, keys)
    assert placed.startswith("native library placed from the snapshot"), placed
    assert str(tmp_path / "a" / "native" / keys["load_key"]) in placed and native.isa() in placed
    again = _adopt_in(tmp_path / "a", blob, keys)
    assert again.startswith("the native library was in the cache already"), again
    other = _adopt_in(tmp_path / "b", blob, keys | {"load_key": "0" * 24})
    assert other.startswith("the snapshot's native library was built for other"), other
    assert "None | None" in other, "nothing loaded, nothing built"
    for bad in ({"load_key": "../" * 8, "build_key": keys["build_key"]}, None):
        assert "malformed keys" in _adopt_in(tmp_path / "c", blob, bad)


def test_a_sandboxed_worker_takes_the_library_its_host_built(tmp_path):
    """What the launcher hands its gVisor worker: the host's CPU reading and its native cache
    (``$WARMBOOT_HOST_NATIVE``). With CPU flags hidden (as gVisor's CPUID does) and no
    compiler, the worker copies the host's library into its own cache (which the process
    image captures) and loads it there: the same load key, no 20-60 s build."""
    from warmboot import host

    host_lib = native.library()
    if host_lib is None:
        pytest.skip(f"native kernels unavailable: {native.unavailable_reason()}")
    code = (
        "from warmboot.kernels import native as n\n"
        "from warmboot import host as k\n"
        "k._cpu_info.cache_clear(); k._cpu_info = lambda: ('a sandbox', 'fpu sse2')\n"
        "print(n.library(), '|', n.isa())"
    )
    env = {**os.environ, "CXX": "/nonexistent/g++", "WARMBOOT_CACHE": str(tmp_path / "own")}
    env |= {host.HOST_CPU_ENV: host.host_cpu_features()}
    env |= {host.HOST_NATIVE_ENV: str(host_lib.parent.parent.parent)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    own = tmp_path / "own" / "native" / host_lib.parent.parent.name / host_lib.parent.name
    assert out.stdout.strip() == f"{own / native.LIBRARY_NAME} | {native.isa()}"
    assert (own / native.LIBRARY_NAME).read_bytes() == host_lib.read_bytes()
    del env[host.HOST_CPU_ENV]  # NOTE: the sandbox's own flags: another load key
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "None | None", out.stdout + out.stderr[-2000:]


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


FAKE_CXX = """#!/bin/sh
case " $* " in *" --version "*) echo "stand-in 1"; exit 0;; esac
out=; prev=
for a in "$@"; do [ "$prev" = -o ] && out=$a; prev=$a; done
sleep 0.5
case " $* " in *" -shared "*) cp "$WARMBOOT_TEST_LIBRARY" "$out";; *) : > "$out";; esac
"""
"""A compiler stand-in: each step takes 0.5 s, and its link yields the library this host built
(``make native``'s real build costs about a minute on 2 cores)."""


def test_a_start_without_the_library_does_not_wait_for_its_build(tmp_path):
    """An empty cache: the attention backend serves at once (SDPA) while the library builds
    in a detached builder, and takes the native kernels once it is there."""
    if native.library() is None:
        pytest.skip(f"native kernels unavailable: {native.unavailable_reason()}")
    cxx = tmp_path / "stand-in-g++"
    cxx.write_text(FAKE_CXX)
    cxx.chmod(0o755)
    env = {**os.environ, "WARMBOOT_CACHE": str(tmp_path / "cache"), "CXX": str(cxx)}
    env["WARMBOOT_TEST_LIBRARY"] = str(native.library())
    code = (
        "import time\n"
        "from warmboot.kernels import native\n"
        "from warmboot.kernels.torch_attention import TorchAttentionBackend\n"
        "t0 = time.perf_counter(); b = TorchAttentionBackend(); first = b.native\n"
        "waited = time.perf_counter() - t0\n"
        "while not native.ready() and time.perf_counter() - t0 < 300: time.sleep(0.2)\n"
        "print(first, round(waited, 2), b.native, native.library())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    first, waited, later, lib = out.stdout.split()
    assert first == "False" and float(waited) < 2.0 and later == "True", out.stdout
    assert lib.startswith(str(tmp_path / "cache" / "native")), "built into the empty cache"


def test_a_sandboxed_worker_takes_the_instruction_set_its_host_lists():
    """gVisor's CPUID hides AVX-512 BF16; the launcher hands its worker the host's flags
    (``$WARMBOOT_HOST_CPU``) and the kernels run with the best set they list, never a lower
    one than this CPU's own."""
    assert native.host_isa("EPYC | avx2 avx512_bf16 avx512bw avx512f fma") == "avx512_bf16"
    assert native.host_isa("EPYC | avx2 avx512bw avx512f fma") == "avx512"
    assert native.host_isa("Core | avx2 fma sse2") == "avx2"
    assert native.host_isa("Atom | sse2") is None
    if native.library() is None:
        pytest.skip(f"native kernels unavailable: {native.unavailable_reason()}")
    ops, best = torch.ops.warmboot_cpu, native.isa()
    try:
        ops.use_isa("portable")  # NOTE: as gVisor's CPUID would leave it
        assert ops.adopt_host_isa(best) == best and native.isa() == best
        assert ops.adopt_host_isa("portable") == best, "never lowered"
    finally:
        ops.use_isa(best)
    env = {**os.environ, "WARMBOOT_HOST_CPU": "Core | avx2 fma"}
    code = "from warmboot.kernels import native; print(native.isa())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == best, "a host reading below this CPU's lowers nothing"
