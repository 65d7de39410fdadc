"""The launcher asks a ``runsc`` binary its version once: later launches read it from the
cache until the binary is replaced, and a binary that fails is never recorded."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from warmboot.launcher import sandbox


def _fake_runsc(bin_dir: Path, version: str, calls: Path, exit_code: int = 0) -> None:
    path = bin_dir / "runsc"
    path.write_text(
        f"#!/bin/sh\necho x >> {calls}\necho 'runsc version {version}'\nexit {exit_code}\n"
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def fake_bin(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("WARMBOOT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 0)
    return bin_dir


def test_a_binarys_version_is_asked_once_until_it_is_replaced(fake_bin, tmp_path):
    calls = tmp_path / "calls"
    _fake_runsc(fake_bin, "release-1", calls)
    assert sandbox.runsc_status() == ("release-1", "")
    assert sandbox.runsc_status() == ("release-1", "")
    assert calls.read_text().count("x") == 1, "the second launch read the cache"
    (fake_bin / "runsc").unlink()  # NOTE: an upgrade: a new file (another inode and size)
    _fake_runsc(fake_bin, "release-22", calls)
    assert sandbox.runsc_status() == ("release-22", "")
    assert calls.read_text().count("x") == 2


def test_a_failing_binary_is_not_recorded(fake_bin, tmp_path):
    calls = tmp_path / "calls"
    _fake_runsc(fake_bin, "broken", calls, exit_code=3)
    for n in (1, 2):
        version, why = sandbox.runsc_status()
        assert version is None and "exit 3" in why
        assert calls.read_text().count("x") == n


def test_an_unreadable_cache_only_means_asking(fake_bin, tmp_path):
    calls = tmp_path / "calls"
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "runsc_versions.json").write_text("[not json")
    _fake_runsc(fake_bin, "release-3", calls)
    assert sandbox.runsc_status() == ("release-3", "")
    assert sandbox.runsc_status() == ("release-3", "")
    assert calls.read_text().count("x") == 1, "the bad file was replaced"


def test_a_binarys_default_spec_is_asked_once(fake_bin, tmp_path):
    """Each sandboxed start writes a bundle from ``runsc spec``'s default: asked of a binary
    once, then read from the cache (a recorded spec without the parts amended is asked
    again), with the same bundle either way."""
    calls = tmp_path / "calls"
    default = {"ociVersion": "1.0.0", "process": {"args": ["sh"], "cwd": "/"}, "mounts": []}
    script = fake_bin / "runsc"
    script.write_text(  # NOTE: ... spec --bundle DIR -- argv: writes DIR/config.json
        f"#!/bin/sh\necho x >> {calls}\n"
        f"while [ \"$1\" != --bundle ]; do shift; done\necho '{json.dumps(default)}' > $2/config.json\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    spec = sandbox.SandboxSpec(argv=[sys.executable, "-c", "pass"], cwd="/", tmpfs=())
    bundles = []
    for n, cached in ((1, None), (1, None), (2, "[]"), (2, None)):
        if cached is not None:
            path = tmp_path / "cache" / "runsc_specs.json"
            path.write_text(json.dumps({k: cached for k in json.loads(path.read_text())}))
        box = sandbox.Sandbox(spec, tmp_path / f"work-{len(bundles)}")
        bundles.append(json.loads((box.bundle_dir / "config.json").read_text()))
        assert calls.read_text().count("x") == n, (n, cached)
    assert all(b == bundles[0] for b in bundles), "the same bundle, cached or asked"
    assert bundles[0]["ociVersion"] == "1.0.0" and bundles[0]["process"]["args"] == spec.argv
