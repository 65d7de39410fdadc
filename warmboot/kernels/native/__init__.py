"""Native CPU kernels for the decode hot path, written here in C++ (``csrc/``).

Built from the repo's sources with the system's C++ compiler and torch's own headers and
libraries (``torch.utils.cpp_extension``'s include and library paths; no download, no
ninja): one shared library that registers its ops under ``torch.ops.warmboot_cpu``. The
build is cached under ``$WARMBOOT_CACHE/native/<load key>/<build key>/``: the load key hashes
the sources, the flags, torch's version and the CPU's flags (what a library must match to be
loaded here), the build key the compiler's version and torch's library paths. A changed
source, compiler or machine builds again and nothing stale is loaded; a library built
elsewhere for the same load key (a tier-A snapshot carries it: ``carried()``) loads on a
machine without a compiler. ``make native`` (which ``make demo``, ``test`` and ``check`` run)
builds it ahead; otherwise the first engine that wants it starts ``builder.py``, one detached
builder a machine (about 20-60 s once per key; it outlives the process that started it).

Each kernel picks its instruction set at run time from the CPU's flags (AVX-512 with BF16
dot products, else AVX2/FMA, else portable C++): ``isa()`` names the one in use. The bf16
GEMM runs from 4 rows on AMX tiles where the CPU has them and Linux grants the tile state
(``amx()``; not inside gVisor): there the dot products are compute-bound from a few rows.

``library()`` is None, with ``unavailable_reason()`` saying why, where no compiler works or
the platform is not x86-64 Linux; callers then keep torch's and oneDNN's paths.
``$WARMBOOT_NATIVE=0`` turns the kernels off (the A/B switch of ``bench/decode.py``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from functools import cache
from pathlib import Path

import torch

from warmboot.config import cache_root
from warmboot.kernels.native import builder

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
ENV = "WARMBOOT_NATIVE"
# NOTE: -fopenmp: ``at::parallel_for`` is inline, so without it the kernels run on one thread
# whatever torch's count; libgomp.so.1 resolves to the copy torch already loaded
FLAGS = ["-O3", "-std=c++20", "-shared", "-fPIC", "-fno-math-errno", "-fopenmp", "-w"]
LIBRARY_NAME = "warmboot_native.so"

_LOCK = threading.Lock()
_state: dict = {}


def enabled() -> bool:
    return os.environ.get(ENV, "1") not in ("", "0")


def library() -> Path | None:
    """The loaded library's path (built first when the cache lacks it), or None."""
    if not enabled():
        return None
    with _LOCK:
        if "path" not in _state:
            _state["path"], _state["reason"] = _build_and_load()
        return _state["path"]


def ready() -> bool:
    """Whether the library is loaded, without waiting for a build: a library already in the
    cache is loaded now; one that must be built first is left to a detached builder
    (``builder.py``: one a machine, which outlives this process), so a start on a machine that
    never built it serves with torch's kernels meanwhile and takes the library when it lands
    (the cache is looked at once a second at most)."""
    if "path" in _state or not enabled():
        return _state.get("path") is not None
    now = time.monotonic()
    if now < _state.get("next_look", 0.0):
        return False
    _state["next_look"] = now + 1.0
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if _built() or compiler is None or _unbuildable():
        return library() is not None
    failed = _target(compiler).parent / builder.FAILED
    if failed.exists():  # NOTE: no new build per process start; ``make native`` tries again
        _state["path"], _state["reason"] = None, f"the native kernels did not build ({failed})"
        return False
    if "builder" not in _state:
        _state["builder"] = None  # NOTE: on a thread: the spec imports cpp_extension (0.1 s)
        threading.Thread(target=_spawn_builder, args=(compiler,), daemon=True).start()
    return False


def _spawn_builder(compiler: str) -> None:
    _state["builder"] = _start_builder(compiler)  # NOTE: held: no ResourceWarning while it runs


def _unbuildable() -> str | None:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"native kernels are built for x86-64 Linux, not {platform.machine()}"
    return None


def _built() -> bool:
    return _loadable() is not None


def _loadable() -> Path | None:
    """A library for this load key: this compiler's build, else any other's, else (in a
    sandbox) the host's."""
    return _cached() or _from_host()


def _cached() -> Path | None:
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is not None and _target(compiler).exists():
        return _target(compiler)
    built = sorted((cache_root() / "native" / _this_load_key()).glob(f"*/{LIBRARY_NAME}"))
    return built[0] if built else None


def _from_host() -> Path | None:
    """A sandboxed worker's copy of the library its host built (``$WARMBOOT_HOST_NATIVE``,
    the host's cache, read-only in the sandbox) into its own cache, which a process image
    captures: the first boot in gVisor then skips a 20-60 s build. None where there is none."""
    from warmboot.host import HOST_NATIVE_ENV

    host = os.environ.get(HOST_NATIVE_ENV)
    if not host:
        return None
    found = sorted((Path(host) / _this_load_key()).glob(f"*/{LIBRARY_NAME}"))
    if not found:
        return None
    try:
        blob = found[0].read_bytes()
    except OSError:
        return None
    keys = {"load_key": found[0].parent.parent.name, "build_key": found[0].parent.name}
    log.info("%s (from %s)", adopt(blob, keys), found[0])
    return _cached()


def unavailable_reason() -> str | None:
    if not enabled():
        return f"${ENV}=0"
    library()
    return _state.get("reason")


def isa() -> str | None:
    """The instruction set the kernels run with on this CPU (None without the library)."""
    return torch.ops.warmboot_cpu.isa() if library() else None


def amx() -> bool:
    """Whether the bf16 GEMM may use AMX tiles here (CPU flags and the OS's permission)."""
    return bool(torch.ops.warmboot_cpu.amx()) if library() else False


def use_helpers(count: int, cpus: list[int]) -> int:
    """Lend the calling thread's native kernels ``count`` helper threads pinned to ``cpus``
    (``csrc/pool.cpp``: they take work only while their cores are idle); 0 stops them.
    Returns the count serving (0 without the library; stopping never builds it)."""
    if not count and _state.get("path") is None:
        return 0
    return torch.ops.warmboot_cpu.use_helpers(count, cpus) if library() else 0


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of (rows, vocab) logits, by ``csrc/argmax.cpp`` where the
    library is loaded already (never built for it) and takes them: CPU, float32 or bf16."""
    if (
        _state.get("path") is None
        or logits.dim() != 2
        or logits.device.type != "cpu"
        or logits.dtype not in (torch.float32, torch.bfloat16)
        or logits.shape[1] == 0
    ):
        return logits.argmax(dim=-1)
    return torch.ops.warmboot_cpu.argmax(logits)


def helper_chunks() -> int:
    """Chunks the calling thread's helpers have run, all calls (0 without the library)."""
    return torch.ops.warmboot_cpu.helper_chunks() if library() else 0


def carried() -> tuple[bytes, dict] | None:
    """The loaded library and its keys, for a snapshot to carry (None when none is loaded)."""
    path = _state.get("path")
    if path is None:
        return None
    return path.read_bytes(), {"load_key": path.parent.parent.name, "build_key": path.parent.name}


def adopt(blob: bytes, keys: object) -> str:
    """Put a library a snapshot carried (its MAC already verified) into the cache, where its
    load key is this host's and the cache has none; returns what happened, in words."""
    lk, bk = (keys.get("load_key"), keys.get("build_key")) if isinstance(keys, dict) else (0, 0)
    if not (_hex(lk, 24) and _hex(bk, 16)):
        return "the snapshot's native library has malformed keys: not used"
    if lk != _this_load_key():
        return "the snapshot's native library was built for other sources, torch or CPU"
    if _cached() is not None:
        return "the native library was in the cache already"
    target = cache_root() / "native" / lk / bk / LIBRARY_NAME
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(blob)
    os.replace(tmp, target)  # NOTE: atomic: a reader never loads half a file
    return f"native library placed from the snapshot ({len(blob)} bytes)"


def _hex(value: object, length: int) -> bool:
    return (
        isinstance(value, str)
        and len(value) == length
        and all(c in "0123456789abcdef" for c in value)
    )


def _build_and_load() -> tuple[Path | None, str | None]:
    if reason := _unbuildable():
        return None, reason
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    path = _loadable()
    if path is None and compiler is None:
        return None, "no C++ compiler (g++ or $CXX) on PATH"
    try:
        path = path or build(compiler)
        torch.ops.load_library(str(path))
    except (OSError, BuildFailed) as e:
        detail = str(e)
        log.warning("native CPU kernels unavailable (torch's kernels serve): %s", detail)
        return None, f"the native kernels did not build or load: {detail}"
    _adopt_host_isa()
    log.info("native CPU kernels: %s (%s)", path, torch.ops.warmboot_cpu.isa())
    return path, None


HOST_ISAS = (
    ("avx512_bf16", ("avx512_bf16", "avx512bw")),
    ("avx512", ("avx512f", "avx512bw")),
    ("avx2", ("avx2", "fma")),
)
"""The native sets, best first, with the host CPU flags each needs."""


def host_isa(host_cpu: str) -> str | None:
    """The best set a host's ``model | flags`` reading (``warmboot.host.host_cpu_features``)
    lists, or None."""
    from warmboot.host import host_cpu_flags

    flags = host_cpu_flags(host_cpu)
    return next((name for name, need in HOST_ISAS if flags.issuperset(need)), None)


def _adopt_host_isa() -> None:
    """In gVisor CPUID hides sets the host has (AVX-512 BF16 among them), so the sandboxed
    worker would run slower kernels than the host, with other bits (and another canary).
    Where the launcher handed it the host's reading (``$WARMBOOT_HOST_CPU``), the kernels run
    with the best set it lists: the worker runs on that host, and a process image is keyed by
    the host's flags, so it is restored only where they hold. AMX still needs the OS's grant."""
    from warmboot.host import HOST_CPU_ENV

    if (host := os.environ.get(HOST_CPU_ENV)) and (name := host_isa(host)):
        torch.ops.warmboot_cpu.adopt_host_isa(name)


def build(compiler: str) -> Path:
    """The library for this key, built first where the cache lacks it (by the detached
    builder, waited for); returns its path, or raises ``BuildFailed`` with the compiler's
    words."""
    target = _target(compiler)
    if not target.exists():
        _start_builder(compiler, wait=True).wait()
    if not target.exists():
        failed = target.parent / builder.FAILED
        text = failed.read_text(errors="replace") if failed.exists() else "no library came out"
        raise BuildFailed(text)
    return target


class BuildFailed(Exception):
    pass


def _start_builder(compiler: str, wait: bool = False) -> subprocess.Popen:
    """The builder (``builder.py``) as a process of its own session: it outlives this one.
    ``wait``: it waits for a build under way instead of leaving it to its builder."""
    from torch.utils.cpp_extension import include_paths

    target = _target(compiler)
    target.parent.mkdir(parents=True, exist_ok=True)
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    spec = {
        "target": str(target),
        "sources": [str(p) for p in sorted(CSRC.glob("*.cpp"))],
        "headers": [str(p) for p in sorted(CSRC.glob("*.h"))],
        "compile": [compiler, *FLAGS, abi, *(f"-I{p}" for p in include_paths())],
        "compiler": compiler,
        "link_flags": _link_flags(),
    }
    argv = [sys.executable, builder.__file__, *(["--wait"] if wait else []), json.dumps(spec)]
    with open(target.parent / "build.log", "ab") as log_file:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=log_file,
            start_new_session=True,
            close_fds=True,
        )


def _target(compiler: str) -> Path:
    return cache_root() / "native" / _this_load_key() / build_key(compiler) / LIBRARY_NAME


@cache
def _this_load_key() -> str:
    return load_key()


def load_key(sources: list[Path] | None = None) -> str:
    """What a library must match to load here: sources and headers, flags, torch, CPU flags."""
    h = hashlib.sha256()
    for src in sources if sources is not None else sorted(CSRC.glob("*.[ch]*")):
        h.update(src.name.encode() + b"\0" + src.read_bytes())
    h.update(" ".join(FLAGS).encode())
    h.update(torch.__version__.encode())
    h.update(_cpu_flags().encode())
    return h.hexdigest()[:24]


def build_key(compiler: str) -> str:
    """What built it: the compiler's version and the link flags (torch's library paths)."""
    h = hashlib.sha256(_compiler_version(compiler).encode())
    h.update(" ".join(_link_flags()).encode())
    return h.hexdigest()[:16]


def _link_flags() -> list[str]:
    # NOTE: torch's lib dir, as cpp_extension.library_paths() says, without importing it at
    # every load: it imports setuptools (0.11-0.14 s and 11-16 MB of a boot or an image)
    lib = os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "lib")
    return [f"-L{lib}", f"-Wl,-rpath,{lib}", "-fopenmp", "-lc10", "-ltorch_cpu"]


@cache
def _compiler_version(compiler: str) -> str:
    return subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout


def _cpu_flags() -> str:
    """The host's CPU flags, as a sandboxed worker is handed them (``warmboot.host``): gVisor's
    CPUID hides some, and the library built on the host is the one a worker there loads."""
    from warmboot.host import host_cpu_flags

    return " ".join(sorted(host_cpu_flags()))
