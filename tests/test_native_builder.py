"""The native library's first build on a fresh machine (``kernels/native/builder.py``): many
short-lived processes start one build between them, it outlives them, leaves no compiler
behind, and a build killed halfway resumes from its finished objects.

The compiler is a stand-in: a driver script that logs each call and runs a ``cc1plus``
stand-in (a child process, as g++'s driver runs cc1plus), whose link step yields the library
this host built (the real build costs about a minute on 2 cores)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from warmboot.kernels import native

DRIVER = """#!/bin/sh
case " $* " in *" --version "*) echo "stand-in 1"; exit 0;; esac
out=; prev=
for a in "$@"; do [ "$prev" = -o ] && out=$a; prev=$a; done
echo "$out" >> "$WARMBOOT_TEST_LOG"
"$WARMBOOT_TEST_CC1" "$@" || exit 1
case " $* " in *" -shared "*) cp "$WARMBOOT_TEST_LIBRARY" "$out";; *) : > "$out";; esac
"""
CC1 = """#!/usr/bin/env python3
import os, time
calls = len(open(os.environ["WARMBOOT_TEST_LOG"]).read().splitlines())
time.sleep(float(os.environ["WARMBOOT_TEST_SLOW"]) if calls > 2 else 0.3)
"""
"""The first two compiles take 0.3 s, the others ``$WARMBOOT_TEST_SLOW`` seconds."""


@pytest.fixture
def stand_in(tmp_path):
    lib = native.library()
    if lib is None:
        pytest.skip(f"native kernels unavailable: {native.unavailable_reason()}")
    for name, text in (("g++", DRIVER), ("cc1plus", CC1)):
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o755)
    env = {**os.environ, "WARMBOOT_CACHE": str(tmp_path / "cache"), "CXX": str(tmp_path / "g++")}
    env |= {"WARMBOOT_TEST_LOG": str(tmp_path / "calls"), "WARMBOOT_TEST_LIBRARY": str(lib)}
    (tmp_path / "calls").touch()
    return env | {"WARMBOOT_TEST_CC1": str(tmp_path / "cc1plus"), "WARMBOOT_TEST_SLOW": "1"}


def _python(code: str, env: dict, wait: bool = True):
    run = subprocess.run if wait else subprocess.Popen
    kw = {"capture_output": True, "text": True} if wait else {}
    return run([sys.executable, "-c", code], env=env, **kw)


def _processes(marker: str) -> list[int]:
    """Pids whose command line names ``marker``."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if marker.encode() in cmdline.read_bytes() and int(cmdline.parent.name) != os.getpid():
                found.append(int(cmdline.parent.name))
        except (OSError, ValueError):
            continue
    return found


def _calls(env: dict) -> list[str]:
    return Path(env["WARMBOOT_TEST_LOG"]).read_text().splitlines()


def _until(check, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while not check() and time.monotonic() < end:
        time.sleep(0.1)
    return bool(check())


SOURCES = len(list(native.CSRC.glob("*.cpp")))


def test_short_lived_processes_start_one_build_that_outlives_them(stand_in):
    """Four engine processes start at once on an empty cache, each asks for the library
    (``ready``: serve on torch's kernels meanwhile) and exits long before a build could end.
    One build runs (each source compiled once, one link), finishes after they are gone,
    leaves no compiler running, and the next process loads its library at once."""
    code = "import time; from warmboot.kernels import native; print(native.ready()); time.sleep(1)"
    procs = [_python(code, stand_in, wait=False) for _ in range(4)]
    assert [p.wait(timeout=120) for p in procs] == [0] * 4
    assert len(_calls(stand_in)) < SOURCES + 1, "precondition: they exit before the build ends"
    cache = stand_in["WARMBOOT_CACHE"]
    assert _until(lambda: list(Path(cache).glob(f"native/*/*/{native.LIBRARY_NAME}")), 120)
    calls = _calls(stand_in)
    assert len(calls) == SOURCES + 1 and calls[-1].endswith(".tmp"), calls
    assert len({Path(c).name.split(".")[0] for c in calls[:-1]}) == SOURCES, "each source once"
    assert _until(lambda: not _processes(stand_in["WARMBOOT_TEST_CC1"]), 5), "no compiler left"
    assert _until(lambda: not _processes(f'"target": "{cache}'), 5), "the builder ended"
    out = _python("from warmboot.kernels import native; print(native.library())", stand_in)
    assert out.returncode == 0 and out.stdout.strip().startswith(cache), out.stderr[-2000:]
    assert len(_calls(stand_in)) == SOURCES + 1, "loaded, not built again"


def test_a_killed_builder_leaves_no_compiler_and_its_successor_resumes(stand_in):
    """The builder is SIGKILLed with two objects done and two compilers running: its
    compilers' drivers die with it, and the next builder (a process that needs the library
    now: ``library()``) stops the cc1plus they left, compiles only what was not finished,
    and links; no compiler is left running."""
    cache = stand_in["WARMBOOT_CACHE"]
    starter = _python(
        "from warmboot.kernels import native; native.ready(); import time; time.sleep(1)",
        stand_in | {"WARMBOOT_TEST_SLOW": "60"},
    )
    assert starter.returncode == 0, starter.stderr[-2000:]
    assert _until(lambda: len(_calls(stand_in)) >= 4, 30), _calls(stand_in)
    objects = list(Path(cache).glob("native/*/*/objects/*.o"))
    assert len(objects) == 2, objects
    (builder,) = _processes(f'"target": "{cache}')
    os.kill(builder, signal.SIGKILL)
    assert _until(lambda: not _processes(f'"target": "{cache}'), 5)
    assert len(_processes(stand_in["WARMBOOT_TEST_CC1"])) == 2, "precondition: cc1plus orphaned"
    out = _python("from warmboot.kernels import native; print(native.library())", stand_in)
    assert out.returncode == 0 and out.stdout.strip().startswith(cache), out.stderr[-2000:]
    resumed = _calls(stand_in)[4:]
    assert len(resumed) == SOURCES - 2 + 1, resumed
    assert not {Path(o).name for o in objects} & {Path(c).name.rsplit(".", 2)[0] for c in resumed}
    assert not _processes(stand_in["WARMBOOT_TEST_CC1"]), "no compiler left"


def test_a_failed_build_names_the_compilers_words(stand_in, tmp_path):
    """A compiler error: no library, and the reason carries what the compiler said; a process
    that starts later serves without the library and starts no build of its own (``make
    native`` or ``library()`` tries again)."""
    (tmp_path / "cc1plus").write_text("#!/bin/sh\necho 'error: stand-in refuses' >&2\nexit 1\n")
    code = "from warmboot.kernels import native as n; print(n.library(), n.unavailable_reason())"
    out = _python(code, stand_in)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("None the native kernels did not build or load: ")
    assert "error: stand-in refuses" in out.stdout, out.stdout
    assert not _processes(stand_in["WARMBOOT_TEST_CC1"])
    calls = len(_calls(stand_in))
    code = "from warmboot.kernels import native as n; print(n.ready(), n.unavailable_reason())"
    out = _python(code, stand_in)  # NOTE: an engine's start after the failure: no new build
    assert out.stdout.startswith("False the native kernels did not build ("), out.stdout
    time.sleep(1)
    assert len(_calls(stand_in)) == calls, "no build per process start after a failure"
