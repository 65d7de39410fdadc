"""The CUDA driver's process checkpoint API, called through ctypes on ``libcuda.so.1``.

A controller process moves another process's GPU state into that process's host memory and
back: ``lock`` (block its CUDA calls) → ``checkpoint`` (copy device memory to host, release
the GPU) → ... → ``restore`` (reacquire the GPU, copy back) → ``unlock``. In between, a
CPU-side checkpoint (gVisor, CRIU) can capture the process with no GPU state in it.

Needs driver ≥ 570 (``cuDriverGetVersion`` ≥ 12080, CUDA 12.8); restore needs the same GPU
type. The target must be another process (the API does not checkpoint the caller).
Restore with GPU remapping (``CUcheckpointRestoreArgs.gpuPairs``) is not wrapped: restore
goes back onto the same devices.

Struct layouts (cuda.h): every args struct is 64 bytes and must be zeroed apart from the
documented fields; ``CUcheckpointRestoreArgs`` gained ``gpuPairs``/``gpuPairsCount`` in later
headers, laid over what CUDA 12.8 declared reserved, so a zeroed struct suits all versions.
"""

from __future__ import annotations

import ctypes
import functools
from enum import IntEnum

from bench.timing import timed

MIN_DRIVER_VERSION = 12080
LIBCUDA = "libcuda.so.1"
SYMBOLS = (
    "cuCheckpointProcessGetState",
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
)


class CudaCheckpointUnavailable(RuntimeError):
    """The API cannot be used here; the message says why."""


class CudaCheckpointError(RuntimeError):
    """A checkpoint API call returned an error."""

    def __init__(self, call: str, pid: int, code: int, name: str):
        super().__init__(f"{call}(pid={pid}) failed: {name} ({code})")
        self.call, self.pid, self.code, self.name = call, pid, code, name


class ProcessState(IntEnum):
    """``CUprocessState``."""

    RUNNING = 0
    LOCKED = 1  # CUDA API locks taken: further CUDA calls block
    CHECKPOINTED = 2  # device memory in host memory, device handles released
    FAILED = 3  # uncorrectable error during checkpoint or restore
    CHECKPOINTING = 4  # later drivers
    RESTORING = 5  # later drivers


class LockArgs(ctypes.Structure):
    """``CUcheckpointLockArgs``: 64 bytes."""

    _fields_ = [
        ("timeoutMs", ctypes.c_uint),  # 0: no timeout
        ("reserved0", ctypes.c_uint),
        ("reserved1", ctypes.c_uint64 * 7),
    ]


class CheckpointArgs(ctypes.Structure):
    """``CUcheckpointCheckpointArgs``: 64 reserved bytes."""

    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


class GpuPair(ctypes.Structure):
    """``CUcheckpointGpuPair``: old and new device UUID."""

    _fields_ = [("oldUuid", ctypes.c_ubyte * 16), ("newUuid", ctypes.c_ubyte * 16)]


class RestoreArgs(ctypes.Structure):
    """``CUcheckpointRestoreArgs``: 64 bytes (12.8: all reserved)."""

    _fields_ = [
        ("gpuPairs", ctypes.POINTER(GpuPair)),
        ("gpuPairsCount", ctypes.c_uint),
        ("reserved", ctypes.c_char * 52),
    ]


class UnlockArgs(ctypes.Structure):
    """``CUcheckpointUnlockArgs``: 64 reserved bytes."""

    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


ARG_TYPES = {
    "cuCheckpointProcessGetState": ctypes.c_int,  # CUprocessState* (an enum: int)
    "cuCheckpointProcessLock": LockArgs,
    "cuCheckpointProcessCheckpoint": CheckpointArgs,
    "cuCheckpointProcessRestore": RestoreArgs,
    "cuCheckpointProcessUnlock": UnlockArgs,
}
assert tuple(ARG_TYPES) == SYMBOLS

# The CUresult codes these calls document, plus common ones; cuGetErrorName covers the rest.
ERROR_NAMES = {
    0: "CUDA_SUCCESS",
    1: "CUDA_ERROR_INVALID_VALUE",
    2: "CUDA_ERROR_OUT_OF_MEMORY",
    3: "CUDA_ERROR_NOT_INITIALIZED",
    4: "CUDA_ERROR_DEINITIALIZED",
    100: "CUDA_ERROR_NO_DEVICE",
    101: "CUDA_ERROR_INVALID_DEVICE",
    201: "CUDA_ERROR_INVALID_CONTEXT",
    304: "CUDA_ERROR_OPERATING_SYSTEM",
    400: "CUDA_ERROR_INVALID_HANDLE",
    401: "CUDA_ERROR_ILLEGAL_STATE",
    500: "CUDA_ERROR_NOT_FOUND",
    800: "CUDA_ERROR_NOT_PERMITTED",
    801: "CUDA_ERROR_NOT_SUPPORTED",
    803: "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
    909: "CUDA_ERROR_TIMEOUT",
    999: "CUDA_ERROR_UNKNOWN",
}


def error_name(code: int, lib: object | None = None) -> str:
    """``CUDA_ERROR_...`` for a CUresult, from the driver when it knows it."""
    getter = getattr(lib, "cuGetErrorName", None)
    if getter is not None:
        text = ctypes.c_char_p()
        if getter(code, ctypes.byref(text)) == 0 and text.value:
            return text.value.decode()
    return ERROR_NAMES.get(code, f"CUDA error {code}")


def format_version(version: int) -> str:
    """12080 -> '12.8'."""
    return f"{version // 1000}.{version % 1000 // 10}"


def check_support(version: int, missing: list[str]) -> None:
    """Raise ``CudaCheckpointUnavailable`` unless the driver version and symbols suffice."""
    if version < MIN_DRIVER_VERSION:
        raise CudaCheckpointUnavailable(
            f"the driver supports CUDA {format_version(version)}; the checkpoint API needs "
            f"CUDA {format_version(MIN_DRIVER_VERSION)} (driver >= 570)"
        )
    if missing:
        raise CudaCheckpointUnavailable(f"{LIBCUDA} lacks {', '.join(missing)}")


class CudaDriver:
    """The five checkpoint calls on a loaded ``libcuda`` (or any object with those names)."""

    def __init__(self, lib: object, version: int = 0):
        self.lib = lib
        self.version = version

    def state(self, pid: int) -> ProcessState:
        out = ctypes.c_int(-1)
        self._call("cuCheckpointProcessGetState", pid, ctypes.pointer(out))
        try:
            return ProcessState(out.value)
        except ValueError:
            raise CudaCheckpointError(
                "cuCheckpointProcessGetState", pid, out.value, f"unknown CUprocessState {out.value}"
            ) from None

    def lock(self, pid: int, timeout_ms: int = 0) -> None:
        """Block the process's CUDA calls (``timeout_ms`` 0: wait as long as it takes)."""
        self._call("cuCheckpointProcessLock", pid, ctypes.pointer(LockArgs(timeoutMs=timeout_ms)))

    def checkpoint(self, pid: int) -> None:
        """Move a locked process's device memory to host memory and release the GPU."""
        self._call("cuCheckpointProcessCheckpoint", pid, ctypes.pointer(CheckpointArgs()))

    def restore(self, pid: int) -> None:
        """Reacquire the GPU and copy device memory back (process stays locked)."""
        self._call("cuCheckpointProcessRestore", pid, ctypes.pointer(RestoreArgs()))

    def unlock(self, pid: int) -> None:
        self._call("cuCheckpointProcessUnlock", pid, ctypes.pointer(UnlockArgs()))

    def suspend(self, pid: int, timeout_ms: int = 10_000) -> dict[str, float]:
        """lock + checkpoint, timed. If checkpoint fails the process is unlocked again."""
        lock_s = timed(self.lock, pid, timeout_ms)
        try:
            checkpoint_s = timed(self.checkpoint, pid)
        except CudaCheckpointError:
            self.unlock(pid)
            raise
        return {"lock_s": lock_s, "checkpoint_s": checkpoint_s}

    def resume(self, pid: int) -> dict[str, float]:
        """restore + unlock, timed."""
        return {"restore_s": timed(self.restore, pid), "unlock_s": timed(self.unlock, pid)}

    def _call(self, name: str, pid: int, arg: object) -> None:
        code = getattr(self.lib, name)(pid, arg)
        if code != 0:
            raise CudaCheckpointError(name, pid, code, error_name(code, self.lib))


def load(libname: str = LIBCUDA) -> CudaDriver:
    """Load ``libcuda``, check the driver and symbols, ``cuInit``. Raises
    ``CudaCheckpointUnavailable`` with the reason."""
    try:
        lib = ctypes.CDLL(libname)
    except OSError as e:
        raise CudaCheckpointUnavailable(f"cannot load {libname} (no NVIDIA driver?): {e}") from e
    version = ctypes.c_int(0)
    code = lib.cuDriverGetVersion(ctypes.byref(version))
    if code != 0:
        raise CudaCheckpointUnavailable(f"cuDriverGetVersion failed: {error_name(code, lib)}")
    check_support(version.value, [s for s in SYMBOLS if not hasattr(lib, s)])
    code = lib.cuInit(0)
    if code != 0:
        raise CudaCheckpointUnavailable(f"cuInit failed: {error_name(code, lib)}")
    for name, arg in ARG_TYPES.items():
        getattr(lib, name).argtypes = [ctypes.c_int, ctypes.POINTER(arg)]
        getattr(lib, name).restype = ctypes.c_int
    return CudaDriver(lib, version.value)


@functools.cache
def driver() -> CudaDriver:
    """The process-wide driver (loaded once; a failure is retried on the next call)."""
    return load()


def status() -> tuple[int | None, str]:
    """(driver version, "") when the API can be used here, else (None, reason)."""
    try:
        return driver().version, ""
    except CudaCheckpointUnavailable as e:
        return None, str(e)


def state(pid: int) -> ProcessState:
    return driver().state(pid)


def lock(pid: int, timeout_ms: int = 0) -> None:
    driver().lock(pid, timeout_ms)


def checkpoint(pid: int) -> None:
    driver().checkpoint(pid)


def restore(pid: int) -> None:
    driver().restore(pid)


def unlock(pid: int) -> None:
    driver().unlock(pid)


def suspend(pid: int, timeout_ms: int = 10_000) -> dict[str, float]:
    return driver().suspend(pid, timeout_ms)


def resume(pid: int) -> dict[str, float]:
    return driver().resume(pid)
