"""The sandboxed worker's spec and the process key: what goes into a tier-P image and so
must match for a restore, and nothing of the launching process's surroundings."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import sys
from importlib import metadata
from pathlib import Path

from warmboot.config import cache_root, pid_alive, resolve_eager
from warmboot.host import HOST_CPU_ENV, HOST_NATIVE_ENV, host_cpu_features
from warmboot.launcher.sandbox import SandboxSpec, delete_containers

STORE_MOUNT = "store-mount"
"""The tier-A store appears inside the sandbox at ``<work_dir>/store-mount``, wherever it
lives on the host: the worker's settings, the sandbox spec and so the process key hold no
host path of the store, and a copied or moved store restores."""


def worker_spec(engine_kwargs: dict, work_dir: Path):
    """The sandboxed worker: its environment, cwd and binds are fixed or derived from the
    settings, never inherited (they are part of the process key and of the image)."""
    root = Path(work_dir).resolve()
    env = {k: os.environ[k] for k in ("WARMBOOT_CACHE", "PYTHONPATH") if k in os.environ}
    env |= {
        "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "PYTHONUNBUFFERED": "1",
        HOST_CPU_ENV: host_cpu_features(),
    }
    env[HOST_NATIVE_ENV] = str(cache_root() / "native")  # NOTE: the host's build, not keyed
    binds = []
    engine = sandboxed(engine_kwargs)
    store = engine_kwargs.get("snapshot_store")
    if store and "://" not in str(store):  # the worker publishes tier A into a local store
        Path(store).mkdir(parents=True, exist_ok=True)
        (root / STORE_MOUNT).mkdir(parents=True, exist_ok=True)
        binds.append((str(Path(store).resolve()), str(root / STORE_MOUNT)))
        engine["snapshot_store"] = str(root / STORE_MOUNT)
    # NOTE: -P: the working directory is not put first on sys.path, so a json.py (or any
    # module) lying there cannot shadow the standard library inside the sandbox
    argv = [sys.executable, "-P", "-m", "warmboot.launcher.worker", json.dumps(engine)]
    # NOTE: the scratch tmpfs (captured in the image) sits on a fixed, otherwise empty path:
    # a tmpfs over /tmp would hide models and stores that live there.
    scratch = root / "scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    env["HOME"] = str(scratch)  # NOTE: tools' caches land in the captured tmpfs, and the
    # host's ~/.cache (models, stores) stays visible
    return SandboxSpec(
        argv=argv, cwd="/", env=env, writable_binds=tuple(binds), tmpfs=(str(scratch),)
    )


def sandboxed(engine: dict) -> dict:
    """Engine settings inside gVisor: an absolute model path, and one torch thread unless
    told otherwise. gVisor traps the futexes torch's intra-op pool syncs with around every
    op: two threads decoded the demo model 3.7x slower than one at batch 16, and one is as
    fast as natively (docs/benchmarks/sandbox_threads.md)."""
    engine = dict(engine)
    if "model" in engine:
        engine["model"] = str(Path(engine["model"]).resolve())
    if engine.get("cpu_threads") is None:
        engine["cpu_threads"] = 1
    if engine.get("enforce_eager") is None:  # NOTE: the worker's environment is fixed
        engine["enforce_eager"] = resolve_eager(None)
    return engine


def process_key_fields(engine: dict, runsc_version: str, spec) -> dict[str, str]:
    """Everything that can change the restored process: model files, engine settings (as
    the worker gets them), versions, CPU, runsc, and the sandbox spec itself. No host path
    of the store, no working directory, no inherited environment: a copied store or a
    server started elsewhere on the same hardware and software restores."""
    from warmboot.snapshot.key import model_files_digest, source_digest

    return {
        "model_files": model_files_digest(Path(engine["model"])),
        "warmboot": metadata.version("warmboot"),
        "warmboot_source": source_digest(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "triton": _version("triton"),
        "runsc": runsc_version,
        "cpu": host_cpu_features(),
        "sandbox_spec": json.dumps(
            {
                "argv": [*spec.argv[:-1], _keyed_settings(spec.argv[-1])],
                "cwd": spec.cwd,
                "env": {k: v for k, v in spec.env.items() if k != HOST_NATIVE_ENV},
                "binds": [dst for _, dst in spec.binds()],
                "tmpfs": spec.tmpfs,
            },
            sort_keys=True,
        ),
    }


NOT_KEYED = ("snapshot_timeout", "snapshot_publish")
"""Worker settings that cannot change a restored process (used only while it first boots)."""


def _keyed_settings(engine_json: str) -> str:
    engine = json.loads(engine_json)
    return json.dumps({k: v for k, v in engine.items() if k not in NOT_KEYED}, sort_keys=True)


def process_key(fields: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def sweep_leftovers(work_root: Path) -> int:
    """Delete the work dirs (image copies, sandbox state) of launchers that are gone (killed
    with -9, crashed); their containers are deleted first. Returns how many were swept."""
    swept = 0
    for entry in Path(work_root).glob("*-*") if Path(work_root).is_dir() else ():
        pid = entry.name.partition("-")[0]
        if not pid.isdigit() or not entry.is_dir() or entry.is_symlink() or pid_alive(int(pid)):
            continue
        for state in entry.glob("*/state"):
            delete_containers(state)
        shutil.rmtree(entry, ignore_errors=True)
        swept += 1
    return swept
    return True
