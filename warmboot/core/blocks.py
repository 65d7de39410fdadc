"""The block pool's pieces: one ``Block`` per KV block (made on first use), the chain hash
of full blocks, and ``PoolState``, a plain copy of a block manager's bookkeeping. Pure Python."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    parent_hash: bytes | None = None
    parent_ref: tuple[int, int] | None = None
    token_ids: tuple[int, ...] = ()
    """Tokens, parent hash and parent (block id, generation) of a hashed block: a hit is
    verified against all three, so even a hash collision cannot hand out KV that was computed
    after another prefix."""
    generation: int = 0
    """Bumped whenever the block loses its cache entry (its content may change)."""

    @property
    def ref(self) -> tuple[int, int]:
        return (self.block_id, self.generation)


class Blocks:
    """The pool's ``Block`` objects, each made on first use: a GPU pool of 100k+ blocks then
    costs nothing at start-up (a list of them took 0.2-0.4 s per 350k)."""

    __slots__ = ("_made", "_size")

    def __init__(self, size: int, made: Mapping[int, Block] | None = None):
        self._made: dict[int, Block] = dict(made or {})
        self._size = size

    def __getitem__(self, block_id: int) -> Block:
        block = self._made.get(block_id)
        if block is None:
            if not 0 <= block_id < self._size:
                raise IndexError(f"block {block_id} is outside the pool of {self._size}")
            block = self._made[block_id] = Block(block_id)
        return block

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[Block]:
        return (self[i] for i in range(self._size))

    def changed(self) -> dict[int, Block]:
        """Copies of the blocks that left their initial state, by id."""
        return {i: replace(b) for i, b in sorted(self._made.items()) if b != Block(i)}


def chain_hash(parent: bytes | None, token_ids: tuple[int, ...]) -> bytes:
    """Collision-resistant hash of a full block given its parent's: equal prefixes give equal
    chains, and a crafted prompt cannot make two different prefixes share KV."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class NoFreeBlocksError(RuntimeError):
    pass


@dataclass(frozen=True)
class PoolState:
    """A copy of a ``BlockManager``'s bookkeeping (``BlockManager.state``), or an explicit,
    possibly inconsistent one to build a manager from (``BlockManager.from_state``)."""

    free: tuple[int, ...] = ()  # unhashed, unreferenced blocks, next to be taken first
    evictable: tuple[int, ...] = ()  # unreferenced cached blocks, least recently used first
    cached: dict[bytes, int] = field(default_factory=dict)  # block hash -> block id
    tables: dict[str, tuple[int, ...]] = field(default_factory=dict)  # seq -> block table
    held: dict[int, int] = field(default_factory=dict)  # block -> external holds
    seq_holds: dict[str, int] = field(default_factory=dict)  # seq -> in-flight steps
    zombies: dict[str, tuple[tuple[int, ...], ...]] = field(default_factory=dict)
    """Per held sequence: its tables freed while it was held."""
    hashed_upto: dict[str, int] = field(default_factory=dict)  # seq -> leading hashed blocks
    blocks: dict[int, Block] = field(default_factory=dict)
    """Blocks not in their initial state (``Block(block_id)``), by id."""
