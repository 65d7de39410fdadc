"""How much cache memory an engine takes: the attention layers' KV blocks and, for models with
state layers, the rows of states kept for the prefix cache (``core.state_prefix``)."""

from __future__ import annotations

import torch

from warmboot.config import CacheConfig
from warmboot.device.runner import ModelRunner
from warmboot.engine.settings import Settings

CPU_DEFAULT_KV_BYTES = 512 << 20
GPU_MEMORY_UTILIZATION = 0.9
CHECKPOINT_SHARE = 4
"""Kept states take at most 1/this of the default KV budget (they are a cache, not capacity)."""


def state_checkpoints(cache: CacheConfig, runner: ModelRunner, settings: Settings) -> int:
    """States kept at block boundaries: ``cache.state_checkpoints`` when set, else two per
    seat within a quarter of the default KV budget; none without state layers or prefix
    caching (then a state model computes every prompt in full)."""
    per_row = runner.state_stats()["state_bytes_per_request"]
    if not per_row or not cache.enable_prefix_caching:
        return 0
    if cache.state_checkpoints is not None:
        return cache.state_checkpoints
    budget = cache.kv_cache_memory_bytes or CPU_DEFAULT_KV_BYTES
    return min(2 * settings.scheduler.max_num_seqs, budget // CHECKPOINT_SHARE // per_row)


def num_kv_blocks(
    cache: CacheConfig, runner: ModelRunner, settings: Settings, checkpoints: int = 0
) -> int:
    """KV blocks for the block manager: ``cache.num_blocks``, the memory budget's, on CUDA what
    the free memory holds beside the state rows, else enough for every seat's full context
    within ``CPU_DEFAULT_KV_BYTES``."""
    per_block, sched = runner.kv_bytes_per_block(), settings.scheduler
    if cache.num_blocks is not None:
        blocks = cache.num_blocks
    elif per_block == 0:  # NOTE: attention-free (Mamba 2): blocks only count tokens
        blocks = -(-sched.max_num_seqs * sched.max_model_len // cache.block_size)
    elif cache.kv_cache_memory_bytes is not None:
        blocks = cache.kv_cache_memory_bytes // per_block
    elif settings.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(settings.device)
        rows = runner.slots.num_slots + 1 + checkpoints
        states = rows * runner.state_stats()["state_bytes_per_request"]
        blocks = int(free - (1 - GPU_MEMORY_UTILIZATION) * total - states) // per_block
    else:
        full = sched.max_num_seqs * sched.max_model_len
        blocks = min(-(-full // cache.block_size), CPU_DEFAULT_KV_BYTES // per_block)
    capacity = blocks * cache.block_size
    if capacity < sched.max_model_len:
        raise ValueError(
            f"the KV cache holds {capacity} tokens ({blocks} blocks), fewer than "
            f"max_model_len={sched.max_model_len}; raise the KV memory budget "
            "or lower max_model_len"
        )
    return blocks
