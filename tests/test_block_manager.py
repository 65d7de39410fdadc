"""BlockManager: ref counts, allocation, prefix caching with verification, LRU eviction, holds.

Pure Python: no torch here (the module under test imports none either).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import warmboot.core.block_manager as kv_cache
from warmboot.core.block_manager import Block, BlockManager, NoFreeBlocksError, PoolState


def run_tokens(bm: BlockManager, seq_id: str, tokens: list[int]) -> list[int]:
    """Allocate a fresh sequence for ``tokens``, mark them all computed, cache its full blocks."""
    assert bm.allocate(seq_id, len(tokens))
    bm.cache_full_blocks(seq_id, tokens, len(tokens))
    bm.check_invariants()
    return list(bm.block_table(seq_id))


# -- construction / allocate / free -----------------------------------------------------------
@pytest.mark.parametrize("num_blocks, block_size", [(0, 4), (4, 0), (-1, 1)])
def test_rejects_empty_pool(num_blocks, block_size):
    with pytest.raises(ValueError):
        BlockManager(num_blocks, block_size)


def test_allocate_grow_free():
    bm = BlockManager(8, 4)
    assert bm.num_free_blocks == 8 and bm.num_used_blocks == 0 and bm.usage == 0
    assert bm.block_table("a") == []
    assert bm.allocate("a", 5)
    table = list(bm.block_table("a"))
    assert len(table) == 2 == bm.blocks_needed(5)
    assert all(bm.blocks[b].ref_count == 1 for b in table)
    assert bm.num_used_blocks == 2 and bm.usage == 2 / 8
    bm.check_invariants()

    # growing within the last block takes nothing; past it appends without moving old blocks
    assert bm.allocate("a", 8)
    assert bm.block_table("a") == table
    assert bm.allocate("a", 9)
    assert bm.block_table("a")[:2] == table and len(bm.block_table("a")) == 3
    # a smaller size never shrinks the table
    assert bm.allocate("a", 1)
    assert len(bm.block_table("a")) == 3

    assert bm.allocate("b", 16)
    assert not set(bm.block_table("a")) & set(bm.block_table("b"))
    assert bm.num_used_blocks == 7
    bm.check_invariants()

    bm.free("a")
    assert bm.block_table("a") == []
    assert bm.num_used_blocks == 4
    bm.free("b")
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 8
    assert all(b.ref_count == 0 for b in bm.blocks)
    bm.check_invariants()


def test_allocation_failure_leaves_state_unchanged():
    bm = BlockManager(4, 4)
    tokens = list(range(9))
    run_tokens(bm, "a", tokens)  # 3 blocks, 2 of them full and cached
    bm.free("a")  # 2 evictable + 2 free
    assert bm.allocate("x", 4)  # 1 free left, 2 evictable
    before = bm.state()

    assert not bm.allocate("b", 13)  # needs 4, only 3 takeable
    assert bm.state() == before
    assert not bm.allocate("x", 17)  # grow by 4, only 3 takeable
    assert bm.state() == before

    # with a prefix of 2 evictable blocks the 2 hits are not extra room: 2 + 2 new > 3
    prefix = bm.find_cached_prefix(tokens + [99, 99, 99, 99])
    assert len(prefix) == 2
    before = bm.state()
    assert not bm.allocate("c", 16, prefix)
    assert bm.state() == before
    bm.check_invariants()
    # ... but 2 hits + 1 new block fit exactly
    assert bm.allocate("c", 12, prefix)
    assert bm.block_table("c")[:2] == prefix
    assert bm.num_free_blocks == 0
    bm.check_invariants()


def test_free_twice_is_a_noop_and_release_detects_double_free():
    bm = BlockManager(4, 2)
    assert bm.allocate("a", 3)
    blocks = bm.block_table("a")
    bm.free("a")
    before = bm.state()
    bm.free("a")
    bm.free("never-allocated")
    assert bm.state() == before
    bm.check_invariants()
    # a table listing blocks that were already released: freeing it is a double free
    stale = BlockManager.from_state(4, 2, replace(before, tables={"a": tuple(blocks)}))
    with pytest.raises(RuntimeError, match="double free"):
        stale.free("a")


def test_prefix_only_starts_a_table():
    bm = BlockManager(8, 2)
    tokens = [1, 2, 3, 4, 5]
    run_tokens(bm, "a", tokens)
    assert bm.allocate("b", 1)
    prefix = bm.find_cached_prefix(tokens)
    assert prefix
    with pytest.raises(ValueError):
        bm.allocate("b", 6, prefix)
    bm.check_invariants()


def test_taking_from_an_exhausted_pool_raises():
    bm = BlockManager(1, 2)
    assert bm.allocate("a", 2)
    assert not bm.allocate("b", 1)  # allocate checks for room before taking any block
    # a pool that counts block 0 twice (free and evictable) passes that check; taking the
    # second block then finds the pool empty instead of handing block 0 out twice
    bm = BlockManager.from_state(1, 2, PoolState(free=(0,), evictable=(0,)))
    with pytest.raises(NoFreeBlocksError):
        bm.allocate("a", 4)


# -- prefix caching ---------------------------------------------------------------------------
def test_a_root_keeps_chains_apart():
    """Blocks cached under a root (what the KV depends on besides the tokens: a long prompt's
    rope) are found under that root only; the same tokens under another root or none miss."""
    bm = BlockManager(16, 2)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    assert bm.allocate("long", len(tokens))
    bm.cache_full_blocks("long", tokens, len(tokens), b"root-a")
    bm.check_invariants()
    assert bm.find_cached_prefix(tokens) == []
    assert bm.find_cached_prefix(tokens, b"root-b") == []
    assert bm.find_cached_prefix(tokens, b"root-a") == bm.block_table("long")[:3]
    run_tokens(bm, "short", tokens)  # NOTE: the same tokens, no root: a chain of their own
    assert bm.find_cached_prefix(tokens) == bm.block_table("short")[:3]
    assert not set(bm.block_table("short")) & set(bm.block_table("long"))


def test_prefix_hit_after_full_blocks_cached():
    bm = BlockManager(16, 4)
    tokens = list(range(10, 20))  # 2 full blocks + 2 tokens
    assert bm.allocate("a", len(tokens))
    table = list(bm.block_table("a"))
    assert bm.find_cached_prefix(tokens) == []  # nothing cached before cache_full_blocks

    bm.cache_full_blocks("a", tokens, 7)  # only the first block is computed and full
    assert bm.blocks[table[0]].block_hash is not None
    assert bm.blocks[table[0]].token_ids == tuple(tokens[:4])
    assert bm.blocks[table[1]].block_hash is None
    assert bm.find_cached_prefix(tokens) == table[:1]

    bm.cache_full_blocks("a", tokens, 10)
    assert bm.blocks[table[1]].token_ids == tuple(tokens[4:8])
    assert bm.blocks[table[2]].block_hash is None  # partial block never cached
    assert bm.find_cached_prefix(tokens) == table[:2]
    assert bm.find_cached_prefix(tokens[:9] + [0, 0, 0, 0]) == table[:2]
    # the block holding the last token is never returned
    assert bm.find_cached_prefix(tokens[:9]) == table[:2]
    assert bm.find_cached_prefix(tokens[:8]) == table[:1]
    assert bm.find_cached_prefix(tokens[:5]) == table[:1]
    assert bm.find_cached_prefix(tokens[:4]) == []
    assert bm.find_cached_prefix(tokens[:1]) == []
    assert bm.find_cached_prefix([]) == []
    # a different first block breaks the chain even when the second block matches
    assert bm.find_cached_prefix([0] + tokens[1:]) == []
    assert bm.find_cached_prefix(tokens[:4] + [0] + tokens[5:]) == table[:1]
    bm.check_invariants()


def test_prefix_hit_is_shared_and_refcounted():
    bm = BlockManager(8, 4)
    tokens = list(range(12))
    table_a = run_tokens(bm, "a", tokens)
    query = tokens + [7, 7]
    prefix = bm.find_cached_prefix(query)
    assert prefix == table_a  # all 3 blocks full; the last token (7) is in a new block
    assert bm.allocate("b", len(query), prefix)
    table_b = bm.block_table("b")
    assert table_b[:3] == table_a and len(table_b) == 4
    assert [bm.blocks[b].ref_count for b in table_a] == [2, 2, 2]
    assert bm.num_used_blocks == 4
    bm.check_invariants()

    bm.free("a")
    assert [bm.blocks[b].ref_count for b in table_a] == [1, 1, 1]
    assert bm.num_used_blocks == 4
    bm.free("b")
    assert bm.num_used_blocks == 0
    assert set(bm.state().evictable) == set(table_a)  # hashed blocks stay cached
    bm.check_invariants()
    assert bm.find_cached_prefix(query) == table_a


def test_counts_prefix_queries_and_hits():
    bm = BlockManager(8, 2)
    run_tokens(bm, "a", [1, 2, 3])
    bm.find_cached_prefix([1, 2, 3])
    bm.find_cached_prefix([9, 9, 9])
    assert (bm.prefix_queries, bm.prefix_hits) == (2, 1)


def test_same_content_twice_keeps_first_copy_cached():
    bm = BlockManager(8, 2)
    tokens = [1, 2, 3, 4, 5]
    assert bm.allocate("a", 5) and bm.allocate("b", 5)
    bm.cache_full_blocks("a", tokens, 5)
    bm.cache_full_blocks("b", tokens, 5)
    table_a, table_b = bm.block_table("a"), bm.block_table("b")
    assert bm.find_cached_prefix(tokens) == table_a[:2]
    assert all(bm.blocks[b].block_hash is None for b in table_b)
    bm.check_invariants()
    bm.free("a")
    bm.free("b")
    assert set(bm.state().evictable) == set(table_a[:2])
    bm.check_invariants()


def test_prefix_caching_disabled():
    bm = BlockManager(8, 2, enable_prefix_caching=False)
    tokens = [1, 2, 3, 4, 5]
    run_tokens(bm, "a", tokens)
    assert all(b.block_hash is None for b in bm.blocks)
    assert bm.find_cached_prefix(tokens) == []
    bm.free("a")
    assert not bm.state().evictable and bm.num_free_blocks == 8
    bm.check_invariants()


def test_hit_verification_rejects_hash_collision(monkeypatch):
    """Every chain hash collides: a different sequence must get no hit."""
    monkeypatch.setattr(kv_cache, "chain_hash", lambda parent, token_ids: 12345)
    bm = BlockManager(16, 4)
    table_a = run_tokens(bm, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.blocks[table_a[0]].block_hash == 12345
    assert bm.find_cached_prefix([5, 6, 7, 8, 1, 2, 3, 4, 0]) == []
    assert bm.find_cached_prefix([9, 9, 9, 9, 9]) == []
    # the genuine prefix still hits
    assert bm.find_cached_prefix([1, 2, 3, 4, 0]) == table_a[:1]
    bm.free("a")
    assert bm.find_cached_prefix([4, 3, 2, 1, 0]) == []
    bm.check_invariants()


def test_hit_verification_checks_the_chain_not_only_the_block(monkeypatch):
    monkeypatch.setattr(kv_cache, "chain_hash", lambda parent, token_ids: 12345)
    bm = BlockManager(16, 4)
    table_a = run_tokens(bm, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    # block 1 of the query holds the same tokens as block 0 of "a", but at positions 4..7
    query = [1, 2, 3, 4, 1, 2, 3, 4, 0]
    hits = bm.find_cached_prefix(query)
    assert hits == table_a[:1]
    assert bm.allocate("b", len(query), hits)
    bm.check_invariants()


def _colliding_hash(collide: dict):
    def chain_hash(parent, token_ids):
        # rigged collisions for the listed keys, a plain (non-resistant) hash elsewhere
        return collide.get((parent, token_ids), hash((parent, token_ids)))

    return chain_hash


def test_hit_verification_survives_a_colliding_parent(monkeypatch):
    h1, h2 = 1001, 1002
    monkeypatch.setattr(
        kv_cache,
        "chain_hash",
        _colliding_hash({(None, (1, 2)): h1, (None, (3, 4)): h1, (h1, (5, 6)): h2}),
    )
    bm = BlockManager(6, 2)
    run_tokens(bm, "a", [1, 2, 9])  # a0 = (1, 2) cached as h1
    # "g" computes the same first block at the same time: its copy stays unhashed, but its
    # second block (5, 6) is cached as h2 with parent hash h1
    g = run_tokens(bm, "g", [1, 2, 5, 6, 0])
    assert bm.blocks[g[0]].block_hash is None and bm.blocks[g[1]].block_hash == h2
    bm.free("a")
    assert bm.allocate("fill", 6)  # takes the 2 free blocks and evicts a0: h1 is gone
    assert bm.find_cached_prefix([1, 2, 0]) == []
    bm.free("fill")
    run_tokens(bm, "p", [3, 4, 7])  # (3, 4) is now cached as h1
    bm.check_invariants()
    # (5, 6) after (3, 4) was never computed: only the first block may hit
    hits = bm.find_cached_prefix([3, 4, 5, 6, 0])
    assert g[1] not in hits


# -- LRU eviction -----------------------------------------------------------------------------
def test_lru_eviction_order():
    bm = BlockManager(4, 2)
    x, y = [1, 2, 3, 4], [5, 6, 7, 8]
    x0, x1 = run_tokens(bm, "x", x)
    y0, y1 = run_tokens(bm, "y", y)
    bm.free("x")  # tail first: x1 then x0
    bm.free("y")
    assert list(bm.state().evictable) == [x1, x0, y1, y0]
    assert bm.num_free_blocks == 4
    assert bm.find_cached_prefix(x + [0]) == [x0, x1]

    order = []
    for i in range(4):
        assert bm.allocate(f"n{i}", 1)
        (got,) = bm.block_table(f"n{i}")
        order.append(got)
        assert bm.blocks[got].block_hash is None and bm.blocks[got].token_ids == ()
        bm.check_invariants()
        if i == 0:  # x's tail evicted, its head still hits
            assert bm.find_cached_prefix(x + [0]) == [x0]
            assert bm.find_cached_prefix(y + [0]) == [y0, y1]
        if i == 1:
            assert bm.find_cached_prefix(x + [0]) == []
    assert order == [x1, x0, y1, y0]
    assert not bm.allocate("full", 1)
    assert bm.find_cached_prefix(y + [0]) == []


def test_free_blocks_are_used_before_evictable_ones():
    bm = BlockManager(5, 2)
    x = [1, 2, 3, 4]
    x0, x1 = run_tokens(bm, "x", x)
    bm.free("x")
    assert bm.allocate("a", 6)  # exactly the 3 never-cached blocks
    assert not {x0, x1} & set(bm.block_table("a"))
    assert bm.find_cached_prefix(x + [0]) == [x0, x1]
    bm.check_invariants()


def test_blocks_revived_by_a_hit_are_not_evicted():
    bm = BlockManager(4, 2)
    x, y = [1, 2, 3, 4], [5, 6, 7, 8]
    x0, x1 = run_tokens(bm, "x", x)
    y0, y1 = run_tokens(bm, "y", y)
    bm.free("x")
    bm.free("y")
    assert list(bm.state().evictable) == [x1, x0, y1, y0]  # x's blocks are the LRU ones

    prefix = bm.find_cached_prefix(x + [9])
    assert prefix == [x0, x1]
    assert bm.allocate("b", 5, prefix)  # the hit takes x0, x1; the new block evicts y1
    assert bm.block_table("b") == [x0, x1, y1]
    assert list(bm.state().evictable) == [y0]
    assert bm.blocks[x0].token_ids == (1, 2) and bm.blocks[x1].token_ids == (3, 4)
    bm.check_invariants()

    assert bm.allocate("c", 2)
    assert bm.block_table("c") == [y0]
    assert not bm.allocate("d", 1)
    # the revived blocks kept their cache entries
    assert bm.find_cached_prefix(x + [0]) == [x0, x1]
    bm.free("b")
    # freed again they are the most recently released: tail first
    assert list(bm.state().evictable) == [x1, x0]
    bm.check_invariants()


def test_reset_prefix_cache_forgets_evictable_blocks_only():
    bm = BlockManager(8, 2)
    x, y = [1, 2, 3, 4], [5, 6, 7, 8]
    run_tokens(bm, "x", x)
    y0, y1 = run_tokens(bm, "y", y)
    bm.free("x")
    bm.reset_prefix_cache()
    bm.check_invariants()
    assert not bm.state().evictable
    assert bm.find_cached_prefix(x + [0]) == []
    assert bm.find_cached_prefix(y + [0]) == [y0, y1]  # in use: still cached
    assert bm.num_used_blocks == 2


# -- hold / unhold ----------------------------------------------------------------------------
def test_hold_keeps_blocks_out_of_the_pool_until_released():
    bm = BlockManager(4, 2)
    tokens = [1, 2, 3, 4, 5]
    table = run_tokens(bm, "a", tokens)  # 3 blocks, 2 cached
    bm.hold(table)
    bm.hold(table[:1])  # two holds on the first block
    assert [bm.blocks[b].ref_count for b in table] == [3, 2, 2]
    bm.check_invariants()

    bm.free("a")
    bm.check_invariants()
    assert bm.num_used_blocks == 3
    state = bm.state()
    assert not set(table) & (set(state.free) | set(state.evictable))
    assert not bm.allocate("b", 3)  # only one block takeable
    assert bm.allocate("b", 2)
    assert bm.block_table("b")[0] not in table
    bm.free("b")

    bm.unhold(table)
    bm.check_invariants()
    assert bm.num_used_blocks == 1
    state = bm.state()
    assert list(state.evictable) == [table[1]] and table[2] in state.free
    bm.unhold(table[:1])
    bm.check_invariants()
    assert bm.num_used_blocks == 0
    assert bm.find_cached_prefix(tokens) == table[:2]


def test_hold_and_unhold_errors():
    bm = BlockManager(4, 2)
    assert bm.allocate("a", 2)
    (b,) = bm.block_table("a")
    with pytest.raises(ValueError, match="not in use"):
        bm.hold([3])  # a free block
    with pytest.raises(ValueError, match="not held"):
        bm.unhold([b])  # in use by a table, but not held
    bm.hold([b])
    bm.unhold([b])
    with pytest.raises(ValueError, match="not held"):
        bm.unhold([b])  # double unhold
    assert bm.blocks[b].ref_count == 1
    bm.check_invariants()
    bm.free("a")
    with pytest.raises(ValueError, match="not in use"):
        bm.hold([b])
    bm.check_invariants()


def test_seq_hold_keeps_a_freed_table_until_the_last_release():
    bm = BlockManager(6, 2)
    tokens = [1, 2, 3, 4, 5]
    table = run_tokens(bm, "a", tokens)  # 3 blocks, 2 cached
    bm.hold_seqs(["a"])
    bm.hold_seqs(["a"])  # two steps in flight
    assert [bm.blocks[b].ref_count for b in table] == [1, 1, 1]  # O(1): no per-block refs
    bm.free("a")  # finished while held: a zombie table
    bm.check_invariants()
    assert bm.num_used_blocks == 3 and bm.num_held_only_blocks == 3
    assert not bm.allocate("b", 7)  # 3 free blocks hold 6 tokens
    bm.unhold_seqs(["a"])
    assert bm.num_used_blocks == 3
    bm.unhold_seqs(["a"])
    bm.check_invariants()
    assert bm.num_used_blocks == 0
    assert list(bm.state().evictable)[-2:] == [table[1], table[0]]  # tail first, as free() does
    assert bm.find_cached_prefix(tokens) == table[:2]


def test_seq_hold_over_a_preemption_and_readmission():
    """Freed (preempted) while held, admitted again with a new table, freed again: both
    tables stay until the sequence's last hold is released."""
    bm = BlockManager(8, 2, enable_prefix_caching=False)
    first = run_tokens(bm, "a", [1, 2, 3])
    bm.hold_seqs(["a"])
    bm.free("a")
    second = run_tokens(bm, "a", [1, 2, 3])
    assert not set(first) & set(second)
    bm.hold_seqs(["a"])
    bm.unhold_seqs(["a"])  # the first step retires; the second still holds "a"
    bm.free("a")
    bm.check_invariants()
    assert bm.num_used_blocks == 4
    bm.unhold_seqs(["a"])
    bm.check_invariants()
    assert bm.num_used_blocks == 0


def test_seq_hold_errors():
    bm = BlockManager(4, 2)
    with pytest.raises(ValueError, match="no blocks"):
        bm.hold_seqs(["x"])
    assert bm.allocate("a", 2)
    with pytest.raises(ValueError, match="not held"):
        bm.unhold_seqs(["a"])
    bm.check_invariants()


def test_cache_full_blocks_starts_at_the_first_unhashed_block():
    bm = BlockManager(8, 2)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    assert bm.allocate("a", 7)
    bm.cache_full_blocks("a", tokens, 4)
    assert bm.state().hashed_upto["a"] == 2
    bm.cache_full_blocks("a", tokens, 7)
    assert bm.state().hashed_upto["a"] == 3
    # a second sequence computing the same content keeps its blocks unhashed (the first copy
    # stays canonical) and retries them on every call
    assert bm.allocate("b", 7)
    bm.cache_full_blocks("b", tokens, 7)
    assert bm.state().hashed_upto["b"] == 0
    bm.free("a")
    bm.reset_prefix_cache()  # the canonical copies are gone: b's blocks take over
    bm.cache_full_blocks("b", tokens, 7)
    assert bm.state().hashed_upto["b"] == 3
    assert bm.find_cached_prefix(tokens + [0]) == bm.block_table("b")[:3]
    bm.check_invariants()


# -- the checker itself -----------------------------------------------------------------------
def _populated() -> tuple[BlockManager, dict[str, int]]:
    """A manager with a block in each state: in use (shared), held, evictable, free."""
    bm = BlockManager(8, 2)
    shared = run_tokens(bm, "a", [1, 2, 3])
    prefix = bm.find_cached_prefix([1, 2, 3])
    assert bm.allocate("b", 3, prefix)
    run_tokens(bm, "e", [7, 8, 9])
    evictable = bm.block_table("e")[0]
    bm.free("e")
    bm.hold(bm.block_table("b")[1:])
    bm.check_invariants()
    roles = {
        "shared": shared[0],
        "held": bm.block_table("b")[1],
        "evictable": evictable,
        "free": bm.state().free[0],
    }
    assert bm.blocks[roles["shared"]].ref_count == 2
    assert roles["evictable"] in bm.state().evictable
    return bm, roles


def _block(state: PoolState, block_id: int) -> Block:
    return state.blocks.get(block_id, Block(block_id))


def _with_block(state: PoolState, block_id: int, **changes) -> PoolState:
    block = replace(_block(state, block_id), **changes)
    return replace(state, blocks={**state.blocks, block_id: block})


def _corrupt_refcount_up(s, r):
    return _with_block(s, r["shared"], ref_count=_block(s, r["shared"]).ref_count + 1)


def _corrupt_refcount_down(s, r):
    return _with_block(s, r["shared"], ref_count=_block(s, r["shared"]).ref_count - 1)


def _corrupt_held_refcount(s, r):
    return _with_block(s, r["held"], ref_count=_block(s, r["held"]).ref_count - 1)


def _corrupt_free_refcount(s, r):
    return _with_block(s, r["free"], ref_count=1)


def _corrupt_used_on_free_list(s, r):
    return replace(s, free=(*s.free, r["shared"]))


def _corrupt_free_list_duplicate(s, r):
    return replace(s, free=(*s.free, r["free"]))


def _corrupt_leak_free_block(s, r):
    return replace(s, free=tuple(b for b in s.free if b != r["free"]))


def _corrupt_leak_evictable_block(s, r):
    return replace(s, evictable=tuple(b for b in s.evictable if b != r["evictable"]))


def _corrupt_free_and_evictable(s, r):
    return replace(s, free=(*s.free, r["evictable"]))


def _corrupt_used_evictable(s, r):
    return replace(s, evictable=(*s.evictable, r["held"]))


def _corrupt_free_block_with_hash(s, r):
    return _with_block(s, r["free"], block_hash=42)


def _corrupt_evictable_without_hash(s, r):
    return _with_block(s, r["evictable"], block_hash=None)


def _corrupt_stale_cache_entry(s, r):
    return replace(s, cached={**s.cached, 42: r["free"]})


def _corrupt_table_lists_twice(s, r):
    a0 = s.tables["a"][0]
    s = replace(s, tables={**s.tables, "a": (*s.tables["a"], a0)})
    return _with_block(s, a0, ref_count=_block(s, a0).ref_count + 1)


def _corrupt_lost_hold(s, r):
    return replace(s, held={})


def test_from_state_round_trips():
    """A manager rebuilt from a state has that state and behaves as the original."""
    bm, _ = _populated()
    copy = BlockManager.from_state(bm.num_blocks, bm.block_size, bm.state())
    assert copy.state() == bm.state()
    copy.check_invariants()
    for m in (bm, copy):
        assert m.allocate("c", 5, m.find_cached_prefix([1, 2, 3, 4, 5]))
        m.free("a")
        m.unhold(m.block_table("b")[1:])
        m.check_invariants()
    assert copy.state() == bm.state()
    with pytest.raises(ValueError, match="bad block"):
        BlockManager.from_state(2, 2, PoolState(blocks={2: Block(2)}))


@pytest.mark.parametrize(
    "corrupt",
    [
        _corrupt_refcount_up,
        _corrupt_refcount_down,
        _corrupt_held_refcount,
        _corrupt_free_refcount,
        _corrupt_used_on_free_list,
        _corrupt_free_list_duplicate,
        _corrupt_leak_free_block,
        _corrupt_leak_evictable_block,
        _corrupt_free_and_evictable,
        _corrupt_used_evictable,
        _corrupt_free_block_with_hash,
        _corrupt_evictable_without_hash,
        _corrupt_stale_cache_entry,
        _corrupt_table_lists_twice,
        _corrupt_lost_hold,
    ],
)
def test_check_invariants_catches_corruption(corrupt):
    bm, roles = _populated()
    bm.check_invariants()
    broken = BlockManager.from_state(bm.num_blocks, bm.block_size, corrupt(bm.state(), roles))
    with pytest.raises(AssertionError):
        broken.check_invariants()


# -- stateful model-based test ----------------------------------------------------------------
ALPHABET = st.integers(0, 2)  # a tiny alphabet so that prefixes repeat
_BASES = ([0, 1, 2] * 4, [2, 2, 1, 1, 0, 0] * 2, [1] * 12)
TOKENS = st.one_of(
    st.lists(ALPHABET, min_size=1, max_size=12),
    # a shared base with a short random tail: prefix hits are frequent
    st.builds(
        lambda base, cut, tail: (base[:cut] + tail) or [0],
        st.sampled_from(_BASES),
        st.integers(0, 12),
        st.lists(ALPHABET, max_size=3),
    ),
)


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / grow / compute+cache / free / hold / unhold / query.

    A model of the KV contents (``kv[(block, slot)] = (token, position)``, written when a
    sequence "computes" its tokens) checks that every prefix hit points at blocks holding exactly
    the query's tokens at the query's positions, and that nothing is written into a block that
    another sequence can read.
    """

    def __init__(self):
        super().__init__()
        self.bm: BlockManager | None = None
        self.seqs: dict[str, dict] = {}  # seq -> {"tokens": [...], "computed": int}
        self.kv: dict[tuple[int, int], tuple[int, int]] = {}
        self.holds: list[list[int]] = []
        self.seq_holds: list[str] = []
        self.next_id = 0

    @precondition(lambda self: self.bm is None)
    @rule(
        num_blocks=st.integers(1, 10),
        block_size=st.sampled_from([1, 2, 4]),
        caching=st.booleans(),
    )
    def init(self, num_blocks, block_size, caching):
        self.bm = BlockManager(num_blocks, block_size, caching)

    # helpers
    def _check_hit(self, tokens: list[int], hits: list[int]) -> None:
        bs = self.bm.block_size
        assert len(hits) * bs <= len(tokens) - 1 or not hits
        assert len(set(hits)) == len(hits)
        for i, block_id in enumerate(hits):
            block = self.bm.blocks[block_id]
            assert block.token_ids == tuple(tokens[i * bs : (i + 1) * bs])
            for j in range(bs):
                pos = i * bs + j
                assert self.kv.get((block_id, j)) == (tokens[pos], pos)

    def _expected_new(self, k: int, prefix: list[int]) -> list[int]:
        """The blocks the next ``k`` takes must get: free ones first, then LRU evictable ones."""
        state = self.bm.state()
        lru = [b for b in state.evictable if b not in prefix]
        return (list(state.free) + lru)[:k]

    def _compute(self, seq_id: str, upto: int) -> None:
        seq, bs = self.seqs[seq_id], self.bm.block_size
        table = self.bm.block_table(seq_id)
        for pos in range(seq["computed"], upto):
            block_id = table[pos // bs]
            # writes only go to a block this sequence alone owns (holds aside) and never cached
            block = self.bm.blocks[block_id]
            assert block.block_hash is None
            assert block.ref_count - self.bm.holds(block_id) == 1
            self.kv[(block_id, pos % bs)] = (seq["tokens"][pos], pos)
        seq["computed"] = max(seq["computed"], upto)

    @precondition(lambda self: self.bm is not None)
    @rule(tokens=TOKENS, use_prefix=st.booleans())
    def allocate_new(self, tokens, use_prefix=True):
        seq_id = f"s{self.next_id}"
        self.next_id += 1
        prefix = self.bm.find_cached_prefix(tokens) if use_prefix else []
        self._check_hit(tokens, prefix)
        before = self.bm.state()
        expected = self._expected_new(self.bm.blocks_needed(len(tokens)) - len(prefix), prefix)
        if self.bm.allocate(seq_id, len(tokens), prefix):
            table = self.bm.block_table(seq_id)
            assert table == prefix + expected
            assert len(table) == self.bm.blocks_needed(len(tokens))
            self.seqs[seq_id] = {
                "tokens": list(tokens),
                "computed": len(prefix) * self.bm.block_size,
            }
        else:
            assert self.bm.state() == before
            needed = self.bm.blocks_needed(len(tokens)) - len(prefix)
            revived = sum(1 for b in prefix if self.bm.blocks[b].ref_count == 0)
            assert needed > self.bm.num_free_blocks - revived

    @precondition(lambda self: self.bm is not None)
    @rule(tokens=TOKENS)
    def whole_request(self, tokens):
        """A short request's life in one go: hit, allocate, compute, cache, free."""
        seq_id = f"s{self.next_id}"
        self.allocate_new(tokens, use_prefix=True)
        if seq_id in self.seqs:
            self._compute(seq_id, len(tokens))
            self.bm.cache_full_blocks(seq_id, tokens, len(tokens))
            self.bm.check_invariants()
            self._free(seq_id)

    @precondition(lambda self: self.bm is not None and self.bm.state().free)
    @rule(token=ALPHABET, spare=st.integers(0, 2))
    def fill_free_list(self, token, spare):
        """Take (nearly) all never-cached free blocks, so the evictable ones are the only room."""
        n = max(len(self.bm.state().free) - spare, 1) * self.bm.block_size
        self.allocate_new([token] * n, use_prefix=False)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), extra=st.lists(ALPHABET, min_size=1, max_size=6))
    def grow(self, data, extra):
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        seq = self.seqs[seq_id]
        new_len = len(seq["tokens"]) + len(extra)
        before = self.bm.state()
        old_table = list(self.bm.block_table(seq_id))
        expected = self._expected_new(max(self.bm.blocks_needed(new_len) - len(old_table), 0), [])
        if self.bm.allocate(seq_id, new_len):
            seq["tokens"].extend(extra)
            table = self.bm.block_table(seq_id)
            assert table == old_table + expected
            assert len(table) == self.bm.blocks_needed(new_len)
        else:
            assert self.bm.state() == before
            assert self.bm.blocks_needed(new_len) - len(old_table) > self.bm.num_free_blocks

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def compute_and_cache(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        seq = self.seqs[seq_id]
        upto = data.draw(st.integers(seq["computed"], len(seq["tokens"])))
        self._compute(seq_id, upto)
        self.bm.cache_full_blocks(seq_id, seq["tokens"], seq["computed"])
        if self.bm.enable_prefix_caching:
            # right after caching, every full computed block is findable (its own copy or an
            # earlier one with the same content)
            computed = seq["computed"]
            query = seq["tokens"][:computed] + [0]
            hits = self.bm.find_cached_prefix(query)
            self._check_hit(query, hits)
            assert len(hits) == computed // self.bm.block_size

    @precondition(lambda self: self.bm is not None)
    @rule(tokens=st.one_of(TOKENS, st.lists(ALPHABET, max_size=14)))
    def query(self, tokens):
        self._check_hit(tokens, self.bm.find_cached_prefix(tokens))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        self._free(data.draw(st.sampled_from(sorted(self.seqs))))

    def _free(self, seq_id: str) -> None:
        del self.seqs[seq_id]
        table = list(self.bm.block_table(seq_id))
        hashes = {b: self.bm.blocks[b].block_hash for b in table}
        self.bm.free(seq_id)
        assert self.bm.block_table(seq_id) == []
        # blocks that dropped to no reference: cached ones become the most recently freed
        # evictable ones (tail first) and keep their hash; the others go to the free list
        released = [b for b in reversed(table) if self.bm.blocks[b].ref_count == 0]
        cached = [b for b in released if hashes[b] is not None]
        state = self.bm.state()
        assert list(state.evictable)[len(state.evictable) - len(cached) :] == cached
        for b in released:
            assert self.bm.blocks[b].block_hash == hashes[b]
            assert (b in state.free) == (hashes[b] is None)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def hold(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        blocks = list(self.bm.block_table(seq_id))
        self.bm.hold(blocks)
        self.holds.append(blocks)

    @precondition(lambda self: self.holds)
    @rule(data=st.data())
    def unhold(self, data):
        blocks = self.holds.pop(data.draw(st.integers(0, len(self.holds) - 1)))
        self.bm.unhold(blocks)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def hold_seq(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        self.bm.hold_seqs([seq_id])
        self.seq_holds.append(seq_id)

    @precondition(lambda self: self.seq_holds)
    @rule(data=st.data())
    def unhold_seq(self, data):
        seq_id = self.seq_holds.pop(data.draw(st.integers(0, len(self.seq_holds) - 1)))
        self.bm.unhold_seqs([seq_id])

    @precondition(lambda self: self.bm is not None)
    @rule()
    def reset_prefix_cache(self):
        self.bm.reset_prefix_cache()
        assert not self.bm.state().evictable

    @invariant()
    def consistent(self):
        if self.bm is None:
            return
        self.bm.check_invariants()
        state = self.bm.state()
        used = set(state.held)
        for seq_id in self.seqs:
            used.update(self.bm.block_table(seq_id))
        assert set(state.tables) == set(self.seqs)
        assert self.bm.num_used_blocks == len(used)
        for block in self.bm.blocks:
            if block.block_hash is not None:
                assert len(block.token_ids) == self.bm.block_size

    def teardown(self):
        if self.bm is None:
            return
        for blocks in self.holds:
            self.bm.unhold(blocks)
        self.bm.unhold_seqs(self.seq_holds)
        for seq_id in list(self.seqs):
            self.bm.free(seq_id)
        self.bm.check_invariants()
        assert self.bm.num_used_blocks == 0


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockManagerStateful = BlockManagerMachine.TestCase
