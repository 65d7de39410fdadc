"""The native library's builder: one detached process per build directory, run as a script
(``python builder.py [--wait] SPEC``, the standard library only: it starts in milliseconds).

- It outlives the process that started it (a session of its own), so a short-lived engine
  process that exits halfway leaves the build running, not orphaned compilers.
- It holds the build directory's lock until the library is linked: one build per key on a
  machine, however many processes want it. Without ``--wait`` a builder that finds the lock
  taken leaves at once; with it, it waits, then builds whatever is still missing.
- It runs as many compilers at once as the cores and the free memory allow (a g++ of these
  sources peaks at 0.5-0.6 GB).
- Each finished object is kept under a name keyed by its command and sources, so a build
  that was killed resumes where it stopped.
- Its compilers run in process groups of their own, killed with it on any exit it sees
  (errors, SIGTERM, SIGINT, SIGHUP); the next builder kills what a SIGKILLed one left behind.
  The library appears with one atomic rename; a failure is written to ``build.failed``.

SPEC is JSON: ``target`` (the library's path), ``sources``, ``headers`` (in the object key),
``compile`` (the argv before ``-c SRC -o OBJ``), ``compiler`` and ``link_flags``.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

COMPILER_BYTES = 768 << 20
"""Memory set aside per compiler when choosing how many run at once."""
FAILED = "build.failed"
GROUPS = "compilers.pgid"
"""The process groups of a builder's running compilers, for the next builder to clear."""
_PR_SET_PDEATHSIG = 1


class BuildError(Exception):
    pass


def main(argv: list[str]) -> int:
    wait = "--wait" in argv
    spec = json.loads(argv[-1])
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _leave)
    return build(spec, wait)


def _leave(signum, frame):
    raise SystemExit(128 + signum)


def build(spec: dict, wait: bool) -> int:
    target = Path(spec["target"])
    out = target.parent
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                return 0
            fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return 0
        _clear_leftovers(out, str(Path(spec["sources"][0]).parent))
        (out / FAILED).unlink(missing_ok=True)
        try:
            objects = _compile_all(spec, out)
            _link(spec, objects, target)
        except (BuildError, OSError) as e:
            (out / FAILED).write_text(str(e))
            return 1
        for obj in objects:
            obj.unlink(missing_ok=True)
    return 0


def jobs() -> int:
    """Compilers to run at once: one a core this process may use, fewer where free memory
    would not hold them."""
    cores = len(os.sched_getaffinity(0))
    return max(1, min(cores, _available_bytes() // COMPILER_BYTES))


def _available_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 1 << 40  # NOTE: unknown: the cores alone bound it


def _object_path(spec: dict, source: Path, out: Path) -> Path:
    h = hashlib.sha256("\0".join(spec["compile"]).encode())
    for path in [source, *map(Path, spec["headers"])]:
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return out / "objects" / f"{source.stem}.{h.hexdigest()[:16]}.o"


def _compile_all(spec: dict, out: Path) -> list[Path]:
    todo = [(Path(s), _object_path(spec, Path(s), out)) for s in spec["sources"]]
    (out / "objects").mkdir(exist_ok=True)
    pending = [(src, obj) for src, obj in todo if not obj.exists()]
    running: list[tuple[subprocess.Popen, Path, Path, Path]] = []
    limit = jobs()
    try:
        while pending or running:
            while pending and len(running) < limit:
                src, obj = pending.pop(0)
                tmp = obj.with_name(f"{obj.name}.{os.getpid()}.tmp")
                argv = [*spec["compile"], "-c", str(src), "-o", str(tmp)]
                err = out / f"{src.stem}.err"
                running.append((_start(argv, err), obj, tmp, err))
                _record_groups(out, running)
            time.sleep(0.05)
            for job in [job for job in running if job[0].poll() is not None]:
                running.remove(job)
                _finish(*job)
    finally:
        for job, _, tmp, _ in running:  # NOTE: an error or a signal: no compiler outlives us
            _kill_group(job.pid)
            tmp.unlink(missing_ok=True)
        (out / GROUPS).unlink(missing_ok=True)
    return [obj for _, obj in todo]


def _finish(job: subprocess.Popen, obj: Path, tmp: Path, err: Path) -> None:
    if job.returncode:
        tmp.unlink(missing_ok=True)
        text = err.read_text(errors="replace")[-2000:]
        raise BuildError(f"{' '.join(job.args[-4:])} exited {job.returncode}:\n{text}")
    err.unlink(missing_ok=True)
    os.replace(tmp, obj)


def _link(spec: dict, objects: list[Path], target: Path) -> None:
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    argv = [spec["compiler"], "-shared", *map(str, objects), "-o", str(tmp), *spec["link_flags"]]
    done = subprocess.run(argv, capture_output=True, preexec_fn=_own_group)
    if done.returncode:
        tmp.unlink(missing_ok=True)
        text = done.stderr.decode(errors="replace")[-2000:]
        raise BuildError(f"the link exited {done.returncode}:\n{text}")
    os.replace(tmp, target)  # NOTE: atomic: a reader never loads half a file


def _start(argv: list[str], err: Path) -> subprocess.Popen:
    with open(err, "wb") as stderr:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            preexec_fn=_own_group,
        )


def _own_group() -> None:
    """In the child before exec: a process group of its own (the driver and the cc1plus it
    starts die together), and killed if the builder dies first."""
    os.setpgid(0, 0)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _record_groups(out: Path, running: list) -> None:
    (out / GROUPS).write_text(" ".join(str(job[0].pid) for job in running))


def _clear_leftovers(out: Path, sources: str) -> None:
    """A builder killed with SIGKILL could not stop its compilers' children: stop them now
    (the groups it recorded, where their processes still run a compiler of this build)."""
    try:
        groups = [int(g) for g in (out / GROUPS).read_text().split()]
    except (OSError, ValueError):
        return
    for pgid in groups:
        if _runs_here(pgid, sources):
            _kill_group(pgid)
    (out / GROUPS).unlink(missing_ok=True)
    for tmp in (out / "objects").glob("*.tmp"):
        tmp.unlink(missing_ok=True)


def _runs_here(pgid: int, mark: str) -> bool:
    """Whether a process of group ``pgid`` names ``mark`` (the sources' folder: the driver
    and its cc1plus do) on its command line: a group id since reused by another is not."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            if mark.encode() in (stat.parent / "cmdline").read_bytes():
                return True
        except (OSError, ValueError, IndexError):
            continue
    return False


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
