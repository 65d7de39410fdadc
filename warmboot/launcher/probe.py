"""runsc's fixed cost, measured on an empty process (``python -m warmboot.launcher.probe``)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from warmboot.launcher.sandbox import Sandbox, SandboxError, SandboxSpec, runsc_status


def measure_empty_process(work_dir: Path) -> dict:
    """runsc's fixed cost: run / checkpoint / restore of a shell that echoes one line."""
    spec = SandboxSpec(
        argv=["/bin/sh", "-c", 'echo ready; read line; echo "got $line"'],
        cwd="/",
        env={"PATH": "/usr/bin:/bin"},
    )
    image = Path(work_dir) / "image"
    with Sandbox(spec, Path(work_dir) / "sandbox") as sb:
        t0 = time.perf_counter()
        proc = sb.run()
        _expect_line(proc, b"ready\n")
        run_s = time.perf_counter() - t0
        checkpoint_s = sb.checkpoint(image)
        t0 = time.perf_counter()
        proc = sb.restore(image)
        restore_cmd_s = time.perf_counter() - t0
        proc.stdin.write(b"x\n")
        proc.stdin.flush()
        _expect_line(proc, b"got x\n")
        restore_s = time.perf_counter() - t0
    return {
        "runsc_version": runsc_status()[0],
        "run_to_ready_s": run_s,
        "checkpoint_s": checkpoint_s,
        "restore_to_response_s": restore_s,
        "restore_popen_s": restore_cmd_s,
        "image_bytes": (image / "checkpoint.img").stat().st_size,
    }


def _expect_line(proc: subprocess.Popen, want: bytes) -> None:
    got = proc.stdout.readline()
    if got != want:
        raise SandboxError(f"expected {want!r} from the sandboxed shell, got {got!r}")


if __name__ == "__main__":
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(measure_empty_process(Path(sys.argv[1] if len(sys.argv) > 1 else tmp))))
