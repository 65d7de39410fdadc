"""``warmboot snapshot create|ls|inspect|verify|rm|push|pull`` end to end (in-process)."""

from __future__ import annotations

import pytest

from warmboot.cli import main
from warmboot.snapshot.store import LocalStore

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["snapshot", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_snapshot_cli(path, tmp_path, capsys):
    store, other = str(tmp_path / "a"), str(tmp_path / "b")
    model = ["--model", str(path), "--store", store, "--max-model-len", "128"]
    rc, out, _ = run(capsys, "create", *model)
    assert rc == 0 and "created snapshot" in out
    (key,) = LocalStore(store).list_keys()
    rc, out, _ = run(capsys, "create", *model)
    assert rc == 0 and "already in" in out
    rc, out, _ = run(capsys, "ls", "--store", store)
    assert rc == 0 and key[:8] in out and "float32" in out
    rc, out, _ = run(capsys, "inspect", key[:6], "--store", store)
    assert rc == 0
    for field in ("model_files", "engine.block_size = 16", "torch", "triton", "device.cpu_flags"):
        assert field in out
    assert "canary" in out and "lm_head.weight" in out and "model/tokenizer.json" in out
    rc, out, err = run(capsys, "verify", "--store", store)
    assert rc == 0 and f"{key}: ok" in out and "B/s" in err  # tqdm: bytes and rate
    rc, out, _ = run(capsys, "push", "--store", store, "--to", other)
    assert rc == 0 and "0.000 GB present" in out
    rc, out, _ = run(capsys, "pull", key, "--from", other, "--store", store)
    assert rc == 0 and "0.000 GB moved" in out
    chunk = next(iter((tmp_path / "b" / "chunks").glob("??/*")))
    chunk.write_bytes(b"garbage")
    rc, _, err = run(capsys, "verify", "--store", other)
    assert rc == 1 and "error: 1 bad chunks" in err
    rc, out, _ = run(capsys, "rm", key[:6], "--store", store)
    assert rc == 0 and f"removed {key}" in out
    assert LocalStore(store).list_keys() == [] and LocalStore(store).stored_bytes() == 0
    rc, _, err = run(capsys, "inspect", "nope", "--store", store)
    assert rc == 1 and "no snapshot 'nope'" in err
