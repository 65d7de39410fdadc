"""Paged KV-cache block manager with reference counts and prefix caching. Pure Python, no torch.

Every block is in exactly one state:
- free: never cached or its cache entry dropped (ref 0, no hash);
- evictable: ref 0 but still holds a hashed full block, reusable by a prefix hit until it is
  evicted least-recently-used;
- in use: ref >= 1 (one per block table that lists it plus one per external hold, e.g. an
  in-flight device step).

In-flight steps hold whole sequences (``hold_seqs``: O(rows) per step, not O(blocks)): a table
freed while its sequence is held turns into external holds on its blocks, released when the
last step holding the sequence retires.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import replace

from warmboot.core.blocks import Block, Blocks, NoFreeBlocksError, PoolState, chain_hash

__all__ = ["Block", "BlockManager", "NoFreeBlocksError", "PoolState", "chain_hash"]


class BlockManager:
    """Owns the block pool and one block table per sequence."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = Blocks(num_blocks)
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[bytes, int] = {}  # block hash -> block id
        self._tables: dict[str, list[int]] = {}
        self._held: Counter[int] = Counter()  # external holds (in-flight steps)
        self._seq_holds: Counter[str] = Counter()
        self._zombies: dict[str, list[list[int]]] = {}  # tables freed while their seq was held
        self._hashed_upto: dict[str, int] = {}  # per table: its leading run of hashed blocks
        self.prefix_hits = 0
        self.prefix_queries = 0

    @classmethod
    def from_state(
        cls,
        num_blocks: int,
        block_size: int,
        state: PoolState,
        enable_prefix_caching: bool = True,
    ) -> BlockManager:
        """A manager with exactly ``state`` (copied, not checked: see ``check_invariants``)."""
        bm = cls(num_blocks, block_size, enable_prefix_caching)
        for block_id, block in state.blocks.items():
            if block_id != block.block_id or not 0 <= block_id < num_blocks:
                raise ValueError(f"bad block {block_id} for a pool of {num_blocks}")
        bm.blocks = Blocks(num_blocks, {i: replace(b) for i, b in state.blocks.items()})
        bm._free = deque(state.free)
        bm._evictable = OrderedDict.fromkeys(state.evictable)
        bm._cached = dict(state.cached)
        bm._tables = {seq_id: list(table) for seq_id, table in state.tables.items()}
        bm._held = Counter(state.held)
        bm._seq_holds = Counter(state.seq_holds)
        bm._zombies = {s: [list(t) for t in tables] for s, tables in state.zombies.items()}
        bm._hashed_upto = dict(state.hashed_upto)
        return bm

    def state(self) -> PoolState:
        """A copy of the pool's bookkeeping, for tests and debugging."""
        return PoolState(
            free=tuple(self._free),
            evictable=tuple(self._evictable),
            cached=dict(self._cached),
            tables={seq_id: tuple(table) for seq_id, table in self._tables.items()},
            held=dict(self._held),
            seq_holds=dict(self._seq_holds),
            zombies={s: tuple(map(tuple, tables)) for s, tables in self._zombies.items()},
            hashed_upto=dict(self._hashed_upto),
            blocks=self.blocks.changed(),
        )

    # -- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free plus evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def num_held_only_blocks(self) -> int:
        """Blocks referenced only by external holds: free once those steps retire."""
        return sum(1 for b, n in self._held.items() if self.blocks[b].ref_count == n)

    @property
    def num_held_blocks(self) -> int:
        """Blocks with at least one external hold (an in-flight step references them)."""
        return len(+self._held)

    def holds(self, block_id: int) -> int:
        """External holds on ``block_id``."""
        return self._held[block_id]

    def block_table(self, seq_id: str) -> list[int]:
        return self._tables.get(seq_id, [])

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache --------------------------------------------------------------------------
    def find_cached_prefix(
        self,
        token_ids: Sequence[int],
        root: bytes | None = None,
        usable: Callable[[list[int]], int] | None = None,
    ) -> list[int]:
        """Block ids of the longest cached run of full blocks at the start of ``token_ids``
        (``root``: what the KV depends on besides the tokens, the first block's parent), cut to
        its first ``usable(run)`` blocks when given (``core.state_prefix``).

        NOTE: the block holding the last token is never returned: its logits must be computed.
        """
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        parent: bytes | None = root
        bs = self.block_size
        for start in range(0, (len(token_ids) - 1) // bs * bs, bs):
            chunk = tuple(token_ids[start : start + bs])
            block_hash = chain_hash(parent, chunk)
            block_id = self._cached.get(block_hash)
            prev = self.blocks[hits[-1]].ref if hits else None
            if block_id is None or not self._verify(self.blocks[block_id], parent, prev, chunk):
                break
            hits.append(block_id)
            parent = block_hash
        if usable is not None:
            hits = hits[: usable(hits)]
        self.prefix_queries += 1
        self.prefix_hits += bool(hits)
        return hits

    def cache_full_blocks(
        self, seq_id: str, token_ids: Sequence[int], num_computed: int, root: bytes | None = None
    ) -> None:
        """Register the full, computed blocks of a sequence in the prefix cache (``root``: as
        ``find_cached_prefix``'s).

        NOTE: a hashed block keeps its hash while a table lists it, so each call starts at the
        table's first unhashed block: O(new blocks) per step, unless a block stays unhashed
        (its content is cached in another block), which is retried on every call."""
        bs = self.block_size
        first = self._hashed_upto.get(seq_id, 0)
        if not self.enable_prefix_caching or num_computed // bs <= first:
            return  # NOTE: most decode steps: no block filled up since the last call
        table = self._tables[seq_id]
        prev = self.blocks[table[first - 1]] if first else None
        parent = prev.block_hash if prev else root
        for i in range(first, min(num_computed // bs, len(table))):
            block = self.blocks[table[i]]
            parent_ref = self._parent_ref(prev, parent)
            if block.block_hash is None:
                chunk = tuple(token_ids[i * bs : (i + 1) * bs])
                block_hash = chain_hash(parent, chunk)
                if prev is not None and parent_ref is None:
                    break  # the parent's entry was evicted: no lookup can reach this block
                if block_hash not in self._cached:  # else computed twice at once: keep first
                    block.block_hash, block.parent_hash = block_hash, parent
                    block.parent_ref, block.token_ids = parent_ref, chunk
                    self._cached[block_hash] = block.block_id
                parent = block_hash
            else:
                if prev is not None and prev.block_hash is not None:
                    block.parent_ref = prev.ref  # NOTE: this table is ground truth for its chain
                parent = block.block_hash
            if first == i and block.block_hash is not None:
                first += 1
            prev = block
        self._hashed_upto[seq_id] = first

    def _parent_ref(self, prev: Block | None, parent: bytes | None) -> tuple[int, int] | None:
        """The block a lookup reaches for ``parent``: this table's own block when it is cached,
        else the cached block with the same hash (same tokens, so the same KV)."""
        if prev is None:
            return None
        if prev.block_hash is not None:
            return prev.ref
        canonical = self._cached.get(parent)
        return None if canonical is None else self.blocks[canonical].ref

    @staticmethod
    def _verify(
        block: Block, parent: bytes | None, parent_ref: tuple[int, int] | None, chunk: tuple
    ) -> bool:
        return (
            block.token_ids == chunk
            and block.parent_hash == parent
            and block.parent_ref == parent_ref
        )

    # -- allocation ----------------------------------------------------------------------------
    def allocate(self, seq_id: str, num_tokens: int, cached_prefix: Sequence[int] = ()) -> bool:
        """Grow the table of ``seq_id`` to hold ``num_tokens`` tokens; False (and no change) if the
        pool cannot. ``cached_prefix`` (from ``find_cached_prefix``) starts a new table."""
        table = self._tables.get(seq_id)
        if table is None:
            table = []
            cached_prefix = list(cached_prefix)
        elif cached_prefix:
            raise ValueError(f"sequence {seq_id} already has blocks; a prefix only starts a table")
        reuse_evictable = sum(1 for b in cached_prefix if self.blocks[b].ref_count == 0)
        new = self.blocks_needed(num_tokens) - len(table) - len(cached_prefix)
        if max(new, 0) > self.num_free_blocks - reuse_evictable:
            return False
        for block_id in cached_prefix:
            self._take(block_id)
            table.append(block_id)
        for _ in range(new):
            table.append(self._take(self._pop_free()))
        self._tables[seq_id] = table
        return True

    def free(self, seq_id: str) -> None:
        """Drop a sequence's table. Tail blocks are released first so they are evicted first.
        While the sequence is held its blocks stay in use, as external holds."""
        table = self._tables.pop(seq_id, None)
        self._hashed_upto.pop(seq_id, None)
        if table is None:
            return
        if self._seq_holds[seq_id]:
            self._held.update(table)  # the table's references become holds: counts unchanged
            self._zombies.setdefault(seq_id, []).append(table)
            return
        for block_id in reversed(table):
            self._release(block_id)

    def hold_seqs(self, seq_ids: Sequence[str]) -> None:
        """An in-flight step references these sequences' blocks: keep them until it retires."""
        for seq_id in seq_ids:
            if seq_id not in self._tables:
                raise ValueError(f"cannot hold sequence {seq_id}: it has no blocks")
        self._seq_holds.update(seq_ids)

    def unhold_seqs(self, seq_ids: Sequence[str]) -> None:
        for seq_id in seq_ids:
            held = self._seq_holds[seq_id]
            if not held:
                raise ValueError(f"sequence {seq_id} is not held")
            if held > 1:
                self._seq_holds[seq_id] = held - 1
                continue
            del self._seq_holds[seq_id]
            for table in self._zombies.pop(seq_id, ()):
                self.unhold(table[::-1])  # tail first, as ``free``

    def hold(self, block_ids: Sequence[int]) -> None:
        """Add an external reference (e.g. an in-flight step) to each block."""
        for block_id in block_ids:
            if self.blocks[block_id].ref_count == 0:
                raise ValueError(f"cannot hold block {block_id}: it is not in use")
            self._held[block_id] += 1
            self.blocks[block_id].ref_count += 1

    def unhold(self, block_ids: Sequence[int]) -> None:
        for block_id in block_ids:
            if self._held[block_id] == 0:
                raise ValueError(f"block {block_id} is not held")
            self._held[block_id] -= 1
            if not self._held[block_id]:
                del self._held[block_id]
            self._release(block_id)

    def reset_prefix_cache(self) -> None:
        """Forget every evictable cached block."""
        while self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            self._uncache(self.blocks[block_id])
            self._free.append(block_id)

    # -- internals -----------------------------------------------------------------------------
    def _pop_free(self) -> int:
        if self._free:
            return self._free.popleft()
        if not self._evictable:
            raise NoFreeBlocksError("KV cache is full")
        block_id, _ = self._evictable.popitem(last=False)
        self._uncache(self.blocks[block_id])
        return block_id

    def _take(self, block_id: int) -> int:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self._evictable.pop(block_id, None)
        block.ref_count += 1
        return block_id

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"double free of KV block {block_id}")
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.block_hash is not None:
                self._evictable[block_id] = None
            else:
                self._free.append(block_id)

    def _uncache(self, block: Block) -> None:
        if block.block_hash is not None and self._cached.get(block.block_hash) == block.block_id:
            del self._cached[block.block_hash]
        block.block_hash, block.parent_hash, block.token_ids = None, None, ()
        block.parent_ref = None
        block.generation += 1

    # -- checks --------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError on a leaked, double-freed or unrefcounted shared block."""
        refs: Counter[int] = Counter(self._held)
        for seq_id, tables in self._zombies.items():
            assert self._seq_holds[seq_id] > 0, f"zombie tables of {seq_id}, which is not held"
            zombie_refs = Counter(b for t in tables for b in t)
            assert not zombie_refs - self._held, f"a zombie block of {seq_id} is not held"
        for seq_id, table in self._tables.items():
            assert len(set(table)) == len(table), f"table of {seq_id} lists a block twice"
            refs.update(table)
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert not free & evictable, "a block is both free and evictable"
        for block in self.blocks:
            bid, expected = block.block_id, refs.get(block.block_id, 0)
            assert block.ref_count == expected, (
                f"block {bid} has ref_count {block.ref_count} but {expected} references"
            )
            in_pool = (bid in free) + (bid in evictable)
            if expected:
                assert not in_pool, f"block {bid} is in use and in the free pool"
            else:
                assert in_pool == 1, f"block {bid} has no reference and is not in the pool (leak)"
            if bid in free:
                assert block.block_hash is None, f"free block {bid} still carries a hash"
            if bid in evictable:
                assert block.block_hash is not None, f"evictable block {bid} has no hash"
        for h, bid in self._cached.items():
            assert self.blocks[bid].block_hash == h, f"cache entry {h} points at a stale block"
