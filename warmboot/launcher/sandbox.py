"""A small, checked wrapper around gVisor's ``runsc``: run a process in a sandbox, checkpoint
it to an image directory, restore it from one.

The sandboxed process talks to its parent over stdin/stdout (binary pipes); stderr goes to a
log file. After ``restore`` the restored process reads and writes the *new* pipes of the
``runsc restore`` invocation: nothing it held on the old ones survives, so the parent must not
checkpoint in the middle of a frame.

Layout of ``work_dir``: ``bundle/config.json`` (the OCI spec), ``state/`` (runsc's ``--root``,
private to this work dir) and ``logs/<container id>.log``.

What ``runsc restore`` needs (checked here, Debian's release 2022-12-19, ptrace platform):

- the image directory written by ``checkpoint`` (``checkpoint.img``, compressed);
- a bundle with the same writable binds (matched by path; each host directory must exist,
  else "no server FD available for filesystem"). tmpfs contents come from the image, and
  ``process.args``/``env``/``cwd`` are not used (the process comes from the image), so a
  ``Sandbox`` built from the same ``SandboxSpec`` in a fresh process restores an image
  written by another (checked: a different argv restores fine, a missing bind does not);
- the same runsc version and host (CPU features): part of the snapshot key, not checked here;
- a fresh container id (the old container has ended and was deleted).

``checkpoint --leave-running`` does not work here (measured: exit 128 "destroying container:
stopping container: context deadline exceeded"; the image is written but the container is
gone and ``runsc run`` exits 137), so ``checkpoint`` always ends the container; to keep
serving, restore from the new image.
``runsc run`` needs ``--network=none`` (it refuses to run with networking in the root
network namespace), and ``--platform=kvm`` hangs at sandbox boot, so the default ptrace
platform is used.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from warmboot.launcher import runsc_versions

LOG_TAIL_BYTES = 4000
RUNSC_TIMEOUT = 60.0


class SandboxError(RuntimeError):
    """A runsc command failed: the message holds the command, its exit code and log tail."""


def runsc_status() -> tuple[str | None, str]:
    """(version string, "") when runsc can be used here, else (None, reason). The version of
    a binary already asked is read from the cache (``runsc --version`` costs 50 ms of every
    launch); a replaced binary has another inode, size or change time and is asked again."""
    path = shutil.which("runsc")
    if path is None:
        return None, "runsc is not installed (apt-get install runsc)"
    if os.geteuid() != 0:
        return None, "runsc needs root here (rootless sandboxes are not supported)"
    if known := runsc_versions.known(path):
        return known, ""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{path} --version failed: {e}"
    first = out.stdout.strip().splitlines()[:1]
    if out.returncode != 0 or not first or not first[0].startswith("runsc version "):
        return None, f"{path} --version gave exit {out.returncode}: {out.stderr.strip()[-200:]}"
    version = first[0].removeprefix("runsc version ").strip()
    runsc_versions.remember(path, version)
    return version, ""


@dataclass(frozen=True)
class SandboxSpec:
    """What to run inside the sandbox. The root file system is the host's, read-only."""

    argv: list[str]
    """The process to run (absolute interpreter path first)."""
    cwd: str
    """Working directory inside the sandbox (absolute)."""
    env: dict[str, str] = field(default_factory=dict)
    """The full environment; ``TMPDIR`` is set to the first tmpfs."""
    writable_binds: tuple[str | tuple[str, str], ...] = ()
    """Host directories bind-mounted read-write (not in the image): a path (mounted at the
    same path) or ``(host dir, path inside)``. ``runsc restore`` matches binds by the path
    inside, so a fixed one lets the host directory move between checkpoint and restore."""

    def binds(self) -> list[tuple[str, str]]:
        """(host dir, path inside) of every writable bind."""
        return [(b, b) if isinstance(b, str) else (b[0], b[1]) for b in self.writable_binds]

    tmpfs: tuple[str, ...] = ("/tmp",)
    """Sandbox-internal tmpfs mounts; their files are captured in the image."""


class Sandbox:
    """One sandboxed process at a time: ``run`` or ``restore`` it, ``checkpoint`` it."""

    def __init__(self, spec: SandboxSpec, work_dir: Path):
        runsc = shutil.which("runsc")
        if runsc is None:
            raise SandboxError(runsc_status()[1])
        if not spec.argv or not os.path.isabs(spec.argv[0]):
            raise ValueError(f"argv[0] must be an absolute path, got {spec.argv[:1]}")
        _check_visible(spec)
        self.spec = spec
        self.runsc = runsc
        self.work_dir = Path(work_dir).resolve()
        self.bundle_dir = self.work_dir / "bundle"
        self.state_dir = self.work_dir / "state"
        self.log_dir = self.work_dir / "logs"
        self.container_id: str | None = None
        self.process: subprocess.Popen | None = None
        for d in (self.bundle_dir, self.state_dir, self.log_dir):
            d.mkdir(parents=True, exist_ok=True)
        if any(self.state_dir.iterdir()):
            self._delete_all()  # stale containers of an earlier Sandbox on this work dir
        self._write_bundle()

    # -- bundle -------------------------------------------------------------------------------
    def _write_bundle(self) -> None:
        config = self._default_spec()
        config["root"] = {"path": "/", "readonly": True}
        config["process"].update(
            terminal=False, args=list(self.spec.argv), cwd=self.spec.cwd, env=self._env()
        )
        config["process"]["rlimits"] = [_nofile_rlimit()]
        config["mounts"] += self._mounts()
        # NOTE: no network namespace path and --network=none: the sandbox gets only loopback.
        (self.bundle_dir / "config.json").write_text(json.dumps(config, indent=2))

    def _default_spec(self) -> dict:
        """``runsc spec``'s output, as this binary wrote it before (``runsc_versions``)."""

        def ask() -> str:
            (self.bundle_dir / "config.json").unlink(missing_ok=True)
            self._runsc("spec", "--bundle", str(self.bundle_dir), "--", *self.spec.argv)
            return (self.bundle_dir / "config.json").read_text()

        return runsc_versions.default_spec(self.runsc, ask)

    def _env(self) -> list[str]:
        env = dict(self.spec.env)
        if self.spec.tmpfs:
            env["TMPDIR"] = self.spec.tmpfs[0]
        return [f"{k}={v}" for k, v in env.items()]

    def _mounts(self) -> list[dict]:
        mounts = [{"destination": d, "type": "tmpfs", "source": "tmpfs"} for d in self.spec.tmpfs]
        cache = self._home_cache()
        if cache is not None and cache not in self.spec.tmpfs:
            mounts.append({"destination": cache, "type": "tmpfs", "source": "tmpfs"})
        for src, dst in self.spec.binds():
            if not os.path.isdir(src) or not os.path.isdir(dst):
                raise SandboxError(f"writable bind {src!r} -> {dst!r} needs both directories")
            mounts.append({"destination": dst, "type": "bind", "source": src, "options": ["rw"]})
        return mounts

    def _home_cache(self) -> str | None:
        """``$HOME/.cache`` as a tmpfs (tools write there), unless it holds the interpreter."""
        home = self.spec.env.get("HOME")
        if not home or not os.path.isdir(os.path.join(home, ".cache")):
            return None
        cache = os.path.join(home, ".cache")
        exe = os.path.realpath(self.spec.argv[0])
        return None if exe.startswith(cache + os.sep) else cache

    # -- lifecycle ----------------------------------------------------------------------------
    def run(self) -> subprocess.Popen:
        """Start ``spec.argv`` in a new sandbox; stdin/stdout are binary pipes."""
        cid = self._start_id()
        cmd = self._cmd("--network=none", "run", "--bundle", str(self.bundle_dir), cid)
        self.process = self._popen(cmd, cid)
        return self.process

    def checkpoint(self, image_dir: Path, timeout: float = 120) -> float:
        """Write the running container to ``image_dir``; the container ends. Returns seconds."""
        cid, proc = self._require_running()
        image_dir = Path(image_dir)
        image_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        self._runsc("checkpoint", f"--image-path={image_dir}", cid, timeout=timeout)
        seconds = time.perf_counter() - t0
        self._end(proc, cid)
        if not (image_dir / "checkpoint.img").is_file():
            raise SandboxError(f"runsc checkpoint wrote no {image_dir}/checkpoint.img")
        return seconds

    def restore(self, image_dir: Path, timeout: float | None = None) -> subprocess.Popen:
        """Continue the process saved in ``image_dir`` in a new sandbox with fresh stdio pipes.

        With ``timeout``, wait until runsc reports the container running: a restore that
        fails (corrupt image, mount mismatch) or takes longer raises ``SandboxError``.
        Without it, return at once; a failed restore shows as the process exiting.
        """
        image = Path(image_dir) / "checkpoint.img"
        if not image.is_file():
            raise SandboxError(f"no snapshot image at {image}")
        if self.process is not None and self.process.poll() is None:
            raise SandboxError(f"container {self.container_id} is still running")
        cid = self._start_id()
        image_arg = f"--image-path={Path(image_dir).resolve()}"
        cmd = self._cmd(
            "--network=none", "restore", image_arg, "--bundle", str(self.bundle_dir), cid
        )
        self.process = self._popen(cmd, cid)
        if timeout is not None:
            self.wait_running(timeout)
        return self.process

    def kill(self) -> None:
        """Kill the sandboxed process (SIGKILL to the container) and wait for runsc to exit."""
        proc, cid = self.process, self.container_id
        if proc is None or cid is None or proc.poll() is not None:
            return
        subprocess.run(self._cmd("kill", cid, "KILL"), capture_output=True, timeout=RUNSC_TIMEOUT)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def delete(self) -> None:
        """Kill and delete every container of this work dir. Idempotent."""
        self.kill()
        self._delete_all()
        if self.process is not None:
            for pipe in (self.process.stdin, self.process.stdout):
                if pipe is not None:
                    pipe.close()
            if self.process.poll() is None:
                self.process.kill()
            self.process.wait()
        self.process = None
        self.container_id = None

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.delete()

    def exited(self, wait: float = 0.5) -> str:
        """Why the sandboxed process ended (runsc's exit status and log), or "" if it still
        runs after ``wait`` seconds."""
        proc = self.process
        try:
            code = None if proc is None else proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            return ""
        return "" if code is None else f"runsc exited with {code}" + self._tail()

    @property
    def log_path(self) -> Path | None:
        """The current container's log (runsc's messages and the process's stderr)."""
        return None if self.container_id is None else self.log_dir / f"{self.container_id}.log"

    # -- helpers ------------------------------------------------------------------------------
    def _cmd(self, *args: str) -> list[str]:
        return [self.runsc, "--root", str(self.state_dir), *args]

    def _runsc(self, *args: str, timeout: float = RUNSC_TIMEOUT) -> str:
        cmd = self._cmd(*args)
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise SandboxError(f"{' '.join(cmd)} timed out after {timeout:.0f} s") from e
        if out.returncode != 0:
            tail = (out.stdout + out.stderr)[-LOG_TAIL_BYTES:]
            raise SandboxError(f"{' '.join(cmd)} failed with exit {out.returncode}:\n{tail}")
        return out.stdout

    def _start_id(self) -> str:
        if self.process is not None and self.process.poll() is None:
            raise SandboxError(f"container {self.container_id} is still running")
        if self.container_id is not None:
            self._delete_all()
        self.container_id = f"wb-{uuid.uuid4().hex[:16]}"
        return self.container_id

    def _popen(self, cmd: list[str], cid: str) -> subprocess.Popen:
        with open(self.log_dir / f"{cid}.log", "wb") as log:
            return subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, cwd=self.work_dir
            )

    def _require_running(self) -> tuple[str, subprocess.Popen]:
        proc, cid = self.process, self.container_id
        if proc is None or cid is None:
            raise SandboxError("no container was started")
        if proc.poll() is not None:
            raise SandboxError(f"container {cid} has exited ({proc.returncode})" + self._tail())
        return cid, proc

    def _end(self, proc: subprocess.Popen, cid: str) -> None:
        """After a checkpoint: wait for ``runsc run``/``restore`` to exit, delete the container."""
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()
        self._delete(cid)

    def wait_running(self, timeout: float) -> None:
        """Until runsc reports the container running (a ``restore`` without its timeout)."""
        cid, proc = self.container_id, self.process
        assert cid is not None and proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SandboxError(f"runsc restore exited with {proc.returncode}" + self._tail())
            if self._state(cid) == "running":
                return
            time.sleep(0.05)
        self.kill()
        raise SandboxError(f"restore of {cid} not running after {timeout:.0f} s" + self._tail())

    def _state(self, cid: str) -> str | None:
        out = subprocess.run(self._cmd("state", cid), capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            return None
        try:
            return json.loads(out.stdout).get("status")
        except json.JSONDecodeError:
            return None

    def _delete(self, cid: str) -> None:
        subprocess.run(
            self._cmd("delete", "-force", cid), capture_output=True, timeout=RUNSC_TIMEOUT
        )

    def _delete_all(self) -> None:
        out = subprocess.run(
            self._cmd("list", "-quiet"), capture_output=True, text=True, timeout=RUNSC_TIMEOUT
        )
        for cid in out.stdout.split():
            self._delete(cid)

    def _tail(self) -> str:
        """The log's head and tail (runsc puts the error first, then possibly a Go stack)."""
        path = self.log_path
        if path is None or not path.is_file():
            return ""
        text = path.read_bytes().decode(errors="replace").strip()
        if len(text) > LOG_TAIL_BYTES:
            half = LOG_TAIL_BYTES // 2
            text = f"{text[:half]}\n[...]\n{text[-half:]}"
        return f"\n--- {path} ---\n{text}" if text else ""


def delete_containers(state_dir: Path) -> None:
    """Kill and delete every container under a runsc ``--root`` (a dead launcher's)."""
    runsc = shutil.which("runsc")
    if runsc is None or not Path(state_dir).is_dir() or not any(Path(state_dir).iterdir()):
        return
    root = ["--root", str(state_dir)]
    try:
        out = subprocess.run(
            [runsc, *root, "list", "-quiet"], capture_output=True, text=True, timeout=RUNSC_TIMEOUT
        )
        for cid in out.stdout.split():
            subprocess.run(
                [runsc, *root, "delete", "-force", cid], capture_output=True, timeout=RUNSC_TIMEOUT
            )
    except (OSError, subprocess.TimeoutExpired):
        pass


def _check_visible(spec: SandboxSpec) -> None:
    """The cwd and the program must not be hidden by one of the sandbox's tmpfs mounts (a
    tmpfs over /tmp hides a checkout or a venv that lives there)."""
    for what, path in (("cwd", spec.cwd), ("program", spec.argv[0])):
        for real in {os.path.abspath(path), os.path.realpath(path)}:
            if any(_under(real, dst) for _, dst in spec.binds()):
                continue
            for mount in spec.tmpfs:
                if _under(real, mount):
                    raise ValueError(
                        f"{what} {path!r} is hidden inside the sandbox by its tmpfs {mount!r}; "
                        "use a writable bind or a tmpfs somewhere else"
                    )


def _under(path: str, top: str) -> bool:
    top = os.path.realpath(top)
    return path == top or path.startswith(top.rstrip(os.sep) + os.sep)


def _nofile_rlimit() -> dict:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return {"type": "RLIMIT_NOFILE", "soft": soft, "hard": hard}
