"""The CUDA checkpoint wrapper on the CPU: the unavailable path, struct layouts against cuda.h,
error translation, and the call sequence against a fake driver."""

from __future__ import annotations

import ctypes
import ctypes.util

import pytest

from bench import cuda_checkpoint_api as cc
from bench.cuda_checkpoint_api import ProcessState as S


@pytest.mark.skipif(ctypes.util.find_library("cuda") is not None, reason="libcuda is present")
def test_unavailable_without_driver_gives_reason():
    version, reason = cc.status()
    assert version is None and "libcuda.so.1" in reason
    with pytest.raises(cc.CudaCheckpointUnavailable, match="cannot load"):
        cc.state(1)


def test_load_missing_library():
    with pytest.raises(cc.CudaCheckpointUnavailable, match="no NVIDIA driver"):
        cc.load("/nonexistent/libcuda.so.1")


def test_check_support():
    cc.check_support(12080, [])
    cc.check_support(13000, [])
    with pytest.raises(cc.CudaCheckpointUnavailable, match=r"CUDA 12\.4.*needs CUDA 12\.8"):
        cc.check_support(12040, [])
    with pytest.raises(cc.CudaCheckpointUnavailable, match="lacks cuCheckpointProcessLock"):
        cc.check_support(12080, ["cuCheckpointProcessLock"])


@pytest.mark.parametrize(
    "struct, fields",
    [
        (cc.LockArgs, {"timeoutMs": 0, "reserved0": 4, "reserved1": 8}),
        (cc.CheckpointArgs, {"reserved": 0}),
        (cc.RestoreArgs, {"gpuPairs": 0, "gpuPairsCount": 8, "reserved": 12}),
        (cc.UnlockArgs, {"reserved": 0}),
    ],
)
def test_args_structs_match_cuda_h(struct, fields):
    assert ctypes.sizeof(struct) == 64
    assert {name: getattr(struct, name).offset for name in fields} == fields
    assert bytes(struct()) == bytes(64)  # zeroed by default, as the driver requires


def test_gpu_pair_and_state_enum():
    assert ctypes.sizeof(cc.GpuPair) == 32 and cc.GpuPair.newUuid.offset == 16
    assert [int(s) for s in S] == [0, 1, 2, 3, 4, 5]
    assert S.CHECKPOINTED.name == "CHECKPOINTED"


def test_error_names():
    assert cc.error_name(401) == "CUDA_ERROR_ILLEGAL_STATE"
    assert cc.error_name(909) == "CUDA_ERROR_TIMEOUT"
    assert cc.error_name(12345) == "CUDA error 12345"
    err = cc.CudaCheckpointError("cuCheckpointProcessLock", 42, 401, cc.error_name(401))
    assert str(err) == "cuCheckpointProcessLock(pid=42) failed: CUDA_ERROR_ILLEGAL_STATE (401)"
    assert cc.format_version(12080) == "12.8" and cc.format_version(13010) == "13.1"


class FakeLib:
    """A driver with the documented state machine: RUNNING → LOCKED → CHECKPOINTED → LOCKED
    → RUNNING; a call in the wrong state gives CUDA_ERROR_ILLEGAL_STATE."""

    MOVES = {
        "cuCheckpointProcessLock": (S.RUNNING, S.LOCKED),
        "cuCheckpointProcessCheckpoint": (S.LOCKED, S.CHECKPOINTED),
        "cuCheckpointProcessRestore": (S.CHECKPOINTED, S.LOCKED),
        "cuCheckpointProcessUnlock": (S.LOCKED, S.RUNNING),
    }

    def __init__(self, fail: str | None = None):
        self.state = S.RUNNING
        self.fail = fail
        self.calls: list[str] = []
        self.lock_timeout = None
        for name in self.MOVES:
            setattr(self, name, self._move(name))

    def cuCheckpointProcessGetState(self, pid, out):
        out.contents.value = int(self.state)
        return 0

    def _move(self, name):
        def call(pid, args):
            self.calls.append(name)
            assert bytes(args.contents) == bytes(64) or name.endswith("Lock")
            if name.endswith("Lock"):
                self.lock_timeout = args.contents.timeoutMs
            if name == self.fail:
                return 2  # CUDA_ERROR_OUT_OF_MEMORY
            src, dst = self.MOVES[name]
            if self.state != src:
                return 401
            self.state = dst
            return 0

        return call


def test_suspend_resume_sequence():
    lib = FakeLib()
    drv = cc.CudaDriver(lib, 12080)
    assert drv.state(7) is S.RUNNING
    times = drv.suspend(7, timeout_ms=5000)
    assert set(times) == {"lock_s", "checkpoint_s"} and lib.lock_timeout == 5000
    assert drv.state(7) is S.CHECKPOINTED
    assert set(drv.resume(7)) == {"restore_s", "unlock_s"}
    assert drv.state(7) is S.RUNNING
    with pytest.raises(cc.CudaCheckpointError, match="ILLEGAL_STATE"):
        drv.restore(7)


def test_failed_checkpoint_unlocks_again():
    lib = FakeLib(fail="cuCheckpointProcessCheckpoint")
    drv = cc.CudaDriver(lib)
    with pytest.raises(cc.CudaCheckpointError, match="OUT_OF_MEMORY") as info:
        drv.suspend(7)
    assert info.value.code == 2 and info.value.pid == 7
    assert lib.calls[-1] == "cuCheckpointProcessUnlock" and drv.state(7) is S.RUNNING
