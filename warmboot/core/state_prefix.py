"""Prefix caching for models with state layers: per-request states kept at block boundaries.

A cached prefix's KV blocks restore the attention layers, but a state layer (linear attention,
SSM, short conv) keeps one state per request, the whole prefix folded in. So the runner also
keeps *checkpoints*: copies of a request's states (every state layer's) taken at a block
boundary, in extra rows of the state tensors, each keyed by the hash of the block that ends
there. A new request takes the longest cached run of KV blocks that ends at a checkpoint,
copies the checkpoint into its own state slot and computes from there; with no checkpoint it
computes from the start (never a reuse that changes the output).

Where states are kept (each a copy of the request's states, no extra compute):
- where the request's cached KV run ended at admission (``mark``): where it left an earlier
  request's tokens, so where the next request with that prefix leaves too (a shared system
  prompt or document resumes whole from its third request on; the second from the first's
  last prefill chunk end before it);
- at the last block boundary of a whole prompt (short of the token whose logits are wanted):
  an identical prompt (``n > 1``, a retry) resumes;
- as it goes, in one row per request that moves along with it: the last boundary of each
  prefill chunk and each decode's boundary, so a preempted request resumes from its latest
  boundary and a finished conversation's next turn from its last.

Rows are claimed when a step is scheduled (a row's old key is dropped at once) and keyed when
that step's results come back: a step scheduled later finds only states a collected step
wrote, and a load or a save runs in the device's step order, so a row read by one step and
overwritten by a later one is read first. Rows are reused least recently used first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from warmboot.core.block_manager import BlockManager, chain_hash
from warmboot.core.request import Request, RequestStatus
from warmboot.core.types import ScheduledRequest


class KVPrefix:
    """Prefix caching by KV blocks alone (models without state layers)."""

    loads = 0
    """Requests that started from kept states."""
    num_kept = 0
    """States kept now."""

    def __init__(self, kv: BlockManager):
        self.kv = kv

    def find(self, req: Request) -> list[int]:
        return self.kv.find_cached_prefix(req.all_token_ids, req.prefix_root)

    def plan(self, req: Request, start: int, n: int) -> dict:
        """What a chunk of ``req`` from ``start`` does with kept states (``ScheduledRequest``),
        planned before the chunk is counted (``req.num_tokens``: its tokens so far)."""
        return {}

    def computed(self, req: Request, s: ScheduledRequest) -> None:
        """``s``'s step came back: its full blocks (and states it kept) are found from now on."""
        if req.status is RequestStatus.RUNNING:
            known = min(req.num_computed_tokens, req.num_known_tokens)
            self.kv.cache_full_blocks(req.request_id, req.all_token_ids, known, req.prefix_root)
        self.bind(req, s)

    def bind(self, req: Request, s: ScheduledRequest) -> None:
        """The states ``s`` kept are found from now on."""

    def forget(self, req: Request) -> None:
        """``req`` finished."""


@dataclass
class _Seat:
    """What the checkpoints know of one live request."""

    load: tuple[int, int] | None = None
    """(tokens of the cached prefix, its checkpoint row), for the chunk that starts there."""
    mark: int = 0
    """Tokens of the cached KV run at admission: where this request left a cached prefix."""
    rolling: int | None = None
    """The row its decode boundaries are kept in."""
    hashes: list[bytes] = field(default_factory=list)
    """Its blocks' chain hashes so far (block ``i`` ends at token ``(i + 1) * block_size``)."""


class StatePrefix(KVPrefix):
    """Checkpoint rows ``rows`` of every state layer's tensors, keyed by block hash."""

    def __init__(self, kv: BlockManager, rows: range):
        super().__init__(kv)
        self.rows = rows
        self._keys: dict[bytes, int] = {}  # block hash -> row
        self._lru: OrderedDict[int, bytes | None] = OrderedDict((r, None) for r in rows)
        """Every row, least recently used first, with the key it holds (None: none yet)."""
        self._owner: dict[int, tuple[str, int]] = {}
        """Per claimed row: the (request, blocks) whose state the step that claimed it writes
        there (a row is keyed only if that is still so when the step comes back)."""
        self._seats: dict[str, _Seat] = {}

    @property
    def num_kept(self) -> int:
        return len(self._keys)

    # -- admission -----------------------------------------------------------------------------
    def find(self, req: Request) -> list[int]:
        seat = self._seats.setdefault(req.request_id, _Seat())
        seat.load, seat.mark = None, 0

        def usable(hits: list[int]) -> int:
            seat.mark = len(hits) * self.kv.block_size
            for k in range(len(hits), 0, -1):
                row = self._keys.get(self.kv.blocks[hits[k - 1]].block_hash)
                if row is not None:
                    self._lru.move_to_end(row)
                    seat.load = (k * self.kv.block_size, row)
                    return k
            return 0

        return self.kv.find_cached_prefix(req.all_token_ids, req.prefix_root, usable)

    # -- scheduling ----------------------------------------------------------------------------
    def plan(self, req: Request, start: int, n: int) -> dict:
        seat = self._seats.setdefault(req.request_id, _Seat())
        load = None
        if seat.load is not None and seat.load[0] == start:
            load, self.loads = seat.load[1], self.loads + 1
        seat.load = None
        bs, end = self.kv.block_size, start + n
        decode = n == 1 and end == req.num_tokens
        points: dict[int, bool] = {}  # boundary -> kept in the request's rolling row
        if decode:
            points[end] = True
        else:
            last = min(end, req.num_tokens - 1) // bs * bs
            points[last] = end < req.num_tokens  # NOTE: a whole prompt's own row
            points[seat.mark] = False
        saves: list[tuple[int, int]] = []
        for b, rolling in sorted(points.items()):
            if not start < b <= end or b % bs:
                continue
            if not decode and self._hash(req, seat, b // bs - 1) in self._keys:
                continue  # kept already (a decode's block is not known yet: kept anyway)
            reuse = seat.rolling if rolling else None
            row = self._claim(req.request_id, b // bs, reuse)
            seat.rolling = row if rolling else seat.rolling
            saves.append((b - start, row))
        return dict(state_load=load, state_saves=tuple(saves))

    def _claim(self, req_id: str, blocks: int, reuse: int | None = None) -> int:
        """A row for the state after ``blocks`` blocks of ``req_id``: ``reuse`` if that request
        still holds it, else the least recently used row; its old key is dropped."""
        row = reuse if reuse is not None and self._holds(reuse, req_id) else next(iter(self._lru))
        key = self._lru.pop(row)
        if key is not None:
            del self._keys[key]
        self._lru[row] = None
        self._owner[row] = (req_id, blocks)
        return row

    def _holds(self, row: int, req_id: str) -> bool:
        owner = self._owner.get(row)
        return owner is not None and owner[0] == req_id

    # -- results -------------------------------------------------------------------------------
    def bind(self, req: Request, s: ScheduledRequest) -> None:
        seat = self._seats.get(req.request_id)
        for offset, row in s.state_saves:
            blocks = (s.start_pos + offset) // self.kv.block_size
            if seat is None or self._owner.get(row) != (req.request_id, blocks):
                continue  # claimed again since: the later step's state is the row's
            key = self._hash(req, seat, blocks - 1)
            if key in self._keys:
                continue  # kept already (two requests computed it at once): keep the first
            self._keys[key], self._lru[row] = row, key
            self._lru.move_to_end(row)

    def forget(self, req: Request) -> None:
        self._seats.pop(req.request_id, None)

    def _hash(self, req: Request, seat: _Seat, block: int) -> bytes:
        """Chain hash of ``req``'s block ``block`` (as the block manager's), memoised."""
        bs, tokens = self.kv.block_size, req.all_token_ids
        while len(seat.hashes) <= block:
            i = len(seat.hashes)
            parent = seat.hashes[-1] if seat.hashes else req.prefix_root
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            assert len(chunk) == bs, "hashed a block whose tokens are not all known"
            seat.hashes.append(chain_hash(parent, chunk))
        return seat.hashes[block]

    def check_invariants(self) -> None:
        assert set(self._lru) == set(self.rows), "a checkpoint row was lost"
        for key, row in self._keys.items():
            assert self._lru[row] == key, f"row {row} does not hold the key that names it"
