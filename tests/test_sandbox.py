"""gVisor sandbox: run a framed-stdio worker with a helper subprocess and a tmpfs scratch file,
checkpoint it, restore it, and check everything survived; corrupt and missing images fail
cleanly. Skipped where runsc cannot be used (CI installs it)."""

from __future__ import annotations

import os
import random
import select
import shutil
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgpack
import pytest

from warmboot.launcher.probe import measure_empty_process
from warmboot.launcher.sandbox import Sandbox, SandboxError, SandboxSpec, runsc_status

VERSION, REASON = runsc_status()
pytestmark = [
    pytest.mark.skipif(VERSION is None, reason=f"runsc unavailable: {REASON}"),
    pytest.mark.slow,  # gVisor
]

FRAME_TIMEOUT = 60.0

WORKER = textwrap.dedent(
    """
    import os, random, struct, subprocess, sys, tempfile
    import msgpack

    inp, out = sys.stdin.buffer, sys.stdout.buffer

    def recv():
        head = inp.read(4)
        if len(head) < 4:
            return None
        return msgpack.unpackb(inp.read(struct.unpack(">I", head)[0]))

    def send(obj):
        data = msgpack.packb(obj)
        out.write(struct.pack(">I", len(data)) + data)
        out.flush()

    echo = "import sys\\nfor line in sys.stdin:\\n    print('echo:' + line.strip(), flush=True)"
    helper = subprocess.Popen([sys.executable, "-c", echo], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, bufsize=1)
    scratch = os.path.join(tempfile.gettempdir(), "scratch.txt")
    with open(scratch, "w") as f:
        f.write("scratch-" + str(os.getpid()))
    with open(os.path.join(sys.argv[1], "from_worker.txt"), "w") as f:
        f.write("written through the bind mount")
    counter, seed = 0, None
    send({"ready": True, "tmpdir": tempfile.gettempdir()})
    while (msg := recv()) is not None:
        counter += 1
        if msg["op"] == "seed":
            seed = msg["seed"]
        helper.stdin.write(msg.get("say", "hi") + "\\n")
        with open(scratch) as f:
            content = f.read()
        with open(os.path.join(sys.argv[1], "counter.txt"), "w") as f:
            f.write(str(counter))
        send({
            "counter": counter,
            "helper": helper.stdout.readline().strip(),
            "helper_alive": helper.poll() is None,
            "scratch": content,
            "draw": None if seed is None else random.Random(seed).random(),
        })
    """
)


class Channel:
    """Length-prefixed msgpack frames over a process's pipes, every read with a timeout."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.buf = b""

    def send(self, obj: object) -> None:
        data = msgpack.packb(obj)
        self.proc.stdin.write(struct.pack(">I", len(data)) + data)
        self.proc.stdin.flush()

    def recv(self, timeout: float = FRAME_TIMEOUT) -> object | None:
        """The next frame, or None at EOF (the process ended). Raises TimeoutError."""
        deadline = time.monotonic() + timeout
        head = self._read(4, deadline)
        if head is None:
            return None
        body = self._read(struct.unpack(">I", head)[0], deadline)
        return None if body is None else msgpack.unpackb(body)

    def _read(self, n: int, deadline: float) -> bytes | None:
        fd = self.proc.stdout.fileno()
        while len(self.buf) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError(f"no frame within the timeout (have {len(self.buf)} bytes)")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    """One worker run and checkpointed: (spec, image dir, first reply, timings)."""
    root = tmp_path_factory.mktemp("sandbox")
    shared = root / "shared"
    shared.mkdir()
    scratch = root / "scratch"
    scratch.mkdir()
    # NOTE: the tmpfs sits on its own path: one over /tmp would hide a checkout (and its venv)
    # that lives under /tmp, as CI's may.
    spec = SandboxSpec(
        argv=[sys.executable, "-u", "-c", WORKER, str(shared)],
        cwd=str(shared),
        writable_binds=(str(shared),),
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.path.expanduser("~")},
        tmpfs=(str(scratch),),
    )
    image = root / "image"
    with Sandbox(spec, root / "first") as sb:
        t0 = time.perf_counter()
        ch = Channel(sb.run())
        ready = ch.recv()
        run_s = time.perf_counter() - t0
        assert ready == {"ready": True, "tmpdir": str(scratch)}, _log(sb)
        assert (shared / "from_worker.txt").read_text() == "written through the bind mount"
        ch.send({"op": "ping", "say": "before"})
        first = ch.recv()
        checkpoint_s = sb.checkpoint(image)
    timings = {"run_to_ready_s": run_s, "checkpoint_s": checkpoint_s}
    timings["image_bytes"] = (image / "checkpoint.img").stat().st_size
    return spec, image, first, timings


def _log(sb: Sandbox) -> str:
    path = sb.log_path
    return path.read_text(errors="replace")[-2000:] if path and path.is_file() else ""


def test_state_survives_checkpoint_and_restore(snapshot, tmp_path):
    spec, image, first, timings = snapshot
    assert first["counter"] == 1 and first["helper"] == "echo:before"
    assert first["scratch"].startswith("scratch-") and first["draw"] is None
    # A new Sandbox from the same spec (as a fresh launcher would build it) restores the image.
    with Sandbox(spec, tmp_path / "restored") as sb:
        t0 = time.perf_counter()
        ch = Channel(sb.restore(image, timeout=60))
        ch.send({"op": "seed", "seed": 1234, "say": "after"})
        reply = ch.recv()
        timings["restore_to_response_s"] = time.perf_counter() - t0
        assert reply is not None, _log(sb)
        assert reply["counter"] == 2  # in-memory state
        assert reply["helper"] == "echo:after" and reply["helper_alive"]  # helper subprocess
        assert reply["scratch"] == first["scratch"]  # tmpfs file
        assert (Path(spec.writable_binds[0]) / "counter.txt").read_text() == "2"  # bind mount
        assert reply["draw"] == random.Random(1234).random()  # value sent after restore
        ch.send({"op": "ping", "say": "again"})
        assert ch.recv()["counter"] == 3
    print(f"\nrunsc {VERSION} worker timings: {timings}")


def test_restore_twice_from_one_image(snapshot, tmp_path):
    """The image is reusable: two restores in turn each continue from the checkpoint."""
    spec, image, _, _ = snapshot
    with Sandbox(spec, tmp_path / "twice") as sb:
        for _ in range(2):
            ch = Channel(sb.restore(image, timeout=60))
            ch.send({"op": "ping"})
            assert ch.recv()["counter"] == 2
            sb.kill()


def _corrupt_flip(img: Path) -> None:
    data = bytearray(img.read_bytes())
    for i in range(len(data) // 3, len(data) // 3 + 64):
        data[i] ^= 0xFF
    img.write_bytes(bytes(data))


def _corrupt_truncate(img: Path) -> None:
    img.write_bytes(img.read_bytes()[: img.stat().st_size // 2])


@pytest.mark.parametrize("corrupt", [_corrupt_flip, _corrupt_truncate])
def test_corrupt_image_fails_cleanly(snapshot, tmp_path, corrupt):
    spec, image, _, _ = snapshot
    bad = tmp_path / "bad"
    shutil.copytree(image, bad)
    corrupt(bad / "checkpoint.img")
    with Sandbox(spec, tmp_path / "corrupt") as sb:
        try:
            ch = Channel(sb.restore(bad, timeout=60))
        except SandboxError as e:
            assert "restore" in str(e)
            return
        # Restore was reported running: the process must then die or answer, never hang.
        ch.send({"op": "ping"})
        reply = ch.recv(timeout=30)
        assert reply is None or reply["counter"] == 2


def test_missing_image_raises(snapshot, tmp_path):
    spec, _, _, _ = snapshot
    with Sandbox(spec, tmp_path / "missing") as sb:
        with pytest.raises(SandboxError, match="no snapshot image"):
            sb.restore(tmp_path / "nowhere")


def test_cwd_hidden_by_tmpfs_is_refused(tmp_path):
    spec = SandboxSpec(argv=["/bin/true"], cwd="/tmp/somewhere", env={})
    with pytest.raises(ValueError, match="cwd '/tmp/somewhere' is hidden inside the sandbox"):
        Sandbox(spec, tmp_path)
    venv_under_tmp = SandboxSpec(argv=["/tmp/checkout/.venv/bin/python"], cwd="/", env={})
    with pytest.raises(ValueError, match="program '/tmp/checkout/.venv/bin/python' is hidden"):
        Sandbox(venv_under_tmp, tmp_path)


def test_checkpoint_without_run_raises(snapshot, tmp_path):
    spec, _, _, _ = snapshot
    with Sandbox(spec, tmp_path / "idle") as sb:
        with pytest.raises(SandboxError, match="no container"):
            sb.checkpoint(tmp_path / "img")


def test_delete_cleans_stale_containers(tmp_path):
    """A Sandbox on a work dir with a leftover container deletes it; delete is idempotent."""
    spec = SandboxSpec(argv=["/bin/sh", "-c", "read line"], cwd="/", env={"PATH": "/bin"})
    sb = Sandbox(spec, tmp_path)
    sb.run()
    stale = sb.container_id
    again = Sandbox(spec, tmp_path)  # simulates a launcher restarting after a crash
    listed = subprocess.run(
        [again.runsc, "--root", str(again.state_dir), "list", "-quiet"],
        capture_output=True,
        text=True,
    ).stdout.split()
    assert stale not in listed
    sb.delete()
    again.delete()
    again.delete()


def test_empty_process_fixed_cost(tmp_path):
    m = measure_empty_process(tmp_path)
    print(f"\nrunsc {VERSION} empty process: {m}")
    assert m["image_bytes"] > 0 and m["restore_to_response_s"] < 30
