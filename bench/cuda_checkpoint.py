"""Checkpoint a process's CUDA state into host memory and restore it in place, with the driver
API (``bench.cuda_checkpoint_api``), on a GPU machine (driver >= 570).

A child process (this file with ``--child``) fills ``--gb`` GB of CUDA tensors with a known
pattern and captures a small CUDA graph, then waits. For each of ``--cycles`` cycles the
parent runs lock -> checkpoint -> (process state, device free memory from
``torch.cuda.mem_get_info`` and ``nvidia-smi``) -> restore -> unlock, then the child checks
every tensor and replays the graph. Each call is timed.

Results go to ``--out`` (default ``$OUT/cuda_checkpoint.json`` when ``$OUT`` is set),
rewritten after every step, so a crash or hang leaves what was done and the step it stopped
at; a watchdog ends the run after ``--timeout`` seconds. The last stdout line is the JSON.
Exit status 0 only when every check passed.

Usage: ``python -m bench.cuda_checkpoint [--gb 4] [--cycles 2] [--timeout 300] [--out PATH]``
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.common import git_tree
from bench.timing import timed

REPO = Path(__file__).resolve().parents[1]
CHUNK_BYTES = 512 << 20
LOCK_TIMEOUT_MS = 10_000
GRAPH_N = 1024

# -- child: owns the CUDA state -----------------------------------------------------------------


def pattern(i: int, n: int, device: str = "cuda"):
    """Chunk i: int32 arange offset by i (distinct per chunk, recomputable)."""
    import torch

    return torch.arange(n, dtype=torch.int32, device=device).add_(i * 1_000_003)


def capture_graph():
    """A CUDA graph of relu(x @ w) + 1 over static tensors, warmed up on a side stream."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(GRAPH_N, GRAPH_N, device="cuda", generator=gen)
    w = torch.randn(GRAPH_N, GRAPH_N, device="cuda", generator=gen)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            torch.relu(x @ w).add_(1)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = torch.relu(x @ w).add_(1)
    graph.replay()
    torch.cuda.synchronize()
    return graph, x, w, y, y.clone()


def verify(chunks: list, graph_state: tuple) -> dict:
    """Every chunk equals its pattern; the graph replays bit-identically and follows new input."""
    import torch

    t0 = time.perf_counter()
    bad = [i for i, c in enumerate(chunks) if not torch.equal(c, pattern(i, c.numel()))]
    graph, x, w, y, y_before = graph_state
    graph.replay()
    same = torch.equal(y, y_before)
    x_old = x.clone()
    x.copy_(torch.randn(x.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1)))
    graph.replay()
    follows = torch.allclose(y, torch.relu(x @ w) + 1, rtol=1e-4, atol=1e-3)
    x.copy_(x_old)
    graph.replay()  # back to the original output for the next cycle
    torch.cuda.synchronize()
    return {
        "tensors_ok": not bad,
        "bad_chunks": bad,
        "graph_same_output": same,
        "graph_follows_input": follows,
        "graph_ok": same and follows,
        "verify_s": time.perf_counter() - t0,
    }


def child_main(gb: float) -> None:
    import torch

    def say(**msg) -> None:
        print(json.dumps(msg), flush=True)

    t0 = time.perf_counter()
    torch.cuda.init()
    n = CHUNK_BYTES // 4
    chunks = [pattern(i, n) for i in range(max(1, round(gb * (1 << 30) / CHUNK_BYTES)))]
    graph_state = capture_graph()
    torch.cuda.synchronize()
    say(
        ready=True,
        own_pid=os.getpid(),
        tensor_bytes=sum(c.numel() * 4 for c in chunks),
        torch_reserved_bytes=torch.cuda.memory_reserved(),
        device=torch.cuda.get_device_name(),
        setup_s=time.perf_counter() - t0,
    )
    for line in sys.stdin:
        op = json.loads(line)["op"]
        if op == "verify":
            say(**verify(chunks, graph_state))
        elif op == "exit":
            break
    # NOTE: no CUDA teardown: if the parent died while we were locked it would block.
    os._exit(0)


# -- parent: the controller ---------------------------------------------------------------------


class Child:
    """The child process with JSON lines over its stdio and a reader thread for timeouts."""

    def __init__(self, gb: float):
        cmd = [sys.executable, "-m", "bench.cuda_checkpoint", "--child", "--gb", str(gb)]
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def send(self, **msg) -> None:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"child sent nothing within {timeout:.0f} s") from None
            if line is None:
                raise RuntimeError(f"child exited with {self.proc.wait()} (see its stderr above)")
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                print(f"child: {line.rstrip()}", file=sys.stderr)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Report:
    """The results dict, written to ``path`` after every step."""

    def __init__(self, path: Path | None):
        self.path = path
        self.data: dict = {"ok": False, "step": "start", **git_tree(), "cycles": []}

    def step(self, name: str, **fields) -> None:
        self.data.update(fields, step=name)
        self.save()

    def save(self) -> None:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(self.data, indent=2))


def free_bytes() -> int:
    import torch

    return torch.cuda.mem_get_info(0)[0]


def smi_apps() -> list[str] | str:
    """nvidia-smi's compute processes (pid, used MiB), or why it could not run."""
    cmd = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"nvidia-smi: {e}"
    return out.stdout.strip().splitlines() if out.returncode == 0 else out.stderr.strip()


def run_cycle(drv, child: Child, pid: int, report: Report, timeout: float) -> dict:
    rec: dict = {"state_before": drv.state(pid).name}
    cycle = len(report.data["cycles"])
    report.step(f"cycle {cycle}: lock")
    rec["lock_s"] = timed(drv.lock, pid, LOCK_TIMEOUT_MS)
    rec["state_locked"] = drv.state(pid).name
    report.step(f"cycle {cycle}: checkpoint")
    rec["checkpoint_s"] = timed(drv.checkpoint, pid)
    rec["state_checkpointed"] = drv.state(pid).name
    rec["free_checkpointed"] = free_bytes()
    time.sleep(1.0)
    rec["free_checkpointed_after_1s"] = free_bytes()
    rec["nvidia_smi_checkpointed"] = smi_apps()
    report.step(f"cycle {cycle}: restore", current=rec)
    rec["restore_s"] = timed(drv.restore, pid)
    rec["state_restored"] = drv.state(pid).name
    report.step(f"cycle {cycle}: unlock", current=rec)
    rec["unlock_s"] = timed(drv.unlock, pid)
    rec["state_unlocked"] = drv.state(pid).name
    rec["free_restored"] = free_bytes()
    rec["nvidia_smi_restored"] = smi_apps()
    report.step(f"cycle {cycle}: verify", current=rec)
    child.send(op="verify")
    rec.update(child.recv(timeout))
    return rec


def cycle_ok(rec: dict, free_ready: int, tensor_bytes: int) -> bool:
    released = rec["free_checkpointed_after_1s"] - free_ready
    rec["released_bytes"] = released
    rec["released_all_tensors"] = released >= 0.95 * tensor_bytes
    states = (rec["state_locked"], rec["state_checkpointed"], rec["state_unlocked"])
    rec["states_ok"] = states == ("LOCKED", "CHECKPOINTED", "RUNNING")
    return (
        rec["tensors_ok"] and rec["graph_ok"] and rec["released_all_tensors"] and rec["states_ok"]
    )


def start_watchdog(seconds: float, report: Report, child_box: list) -> threading.Timer:
    def fire() -> None:
        report.data["error"] = f"watchdog: not done after {seconds:.0f} s, at {report.data['step']}"
        print(report.data["error"], file=sys.stderr)
        faulthandler.dump_traceback(all_threads=True)
        for child in child_box:
            child.kill()
        report.save()
        print(json.dumps(report.data), flush=True)
        os._exit(3)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer


def parent_main(args: argparse.Namespace) -> int:
    from bench import cuda_checkpoint_api as cuda_checkpoint

    out = args.out or (
        Path(os.environ["OUT"]) / "cuda_checkpoint.json" if "OUT" in os.environ else None
    )
    report = Report(out)
    child_box: list[Child] = []
    watchdog = start_watchdog(args.timeout, report, child_box)
    try:
        drv = cuda_checkpoint.load()
        report.step("driver loaded", driver_version=cuda_checkpoint.format_version(drv.version))
        free_start = free_bytes()
        child_box.append(Child(args.gb))
        ready = child_box[0].recv(args.timeout)
        ready["pid"] = child_box[0].proc.pid  # our pid namespace's view (the driver's)
        free_ready = free_bytes()
        report.step("child ready", child=ready, free_start=free_start, free_ready=free_ready)
        ok = True
        for _ in range(args.cycles):
            rec = run_cycle(drv, child_box[0], ready["pid"], report, args.timeout)
            ok = cycle_ok(rec, free_ready, ready["tensor_bytes"]) and ok
            report.data["cycles"].append(rec)
            report.data.pop("current", None)
        child_box[0].send(op="exit")
        report.step("done", ok=ok, child_exit=child_box[0].proc.wait(timeout=60))
    except cuda_checkpoint.CudaCheckpointUnavailable as e:
        report.step("driver check", error=f"unavailable: {e}")
    except Exception as e:  # noqa: BLE001 - report any failure with the step it happened at
        report.step(report.data["step"], error=f"{type(e).__name__}: {e}")
    finally:
        watchdog.cancel()
        for child in child_box:
            child.kill()
    if "error" in report.data:
        print(f"FAILED at {report.data['step']}: {report.data['error']}", file=sys.stderr)
    print(json.dumps(report.data), flush=True)
    return 0 if report.data["ok"] else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=4.0, help="GB of CUDA tensors in the child")
    ap.add_argument("--cycles", type=int, default=2, help="checkpoint/restore cycles")
    ap.add_argument("--timeout", type=float, default=300.0, help="watchdog for the whole run (s)")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default $OUT/...)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child_main(args.gb)
        return 0
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
