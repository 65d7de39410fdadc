"""The waiting queue's order: clients in turn, then calls in turn within a client.

A client is who sent a call (``Request.client``: the server passes the peer address, or a
trusted proxy's header); a call is one API request (``Request.group``), whose prompts and
completions are its sequences. Turns are start-time fair queuing, one unit a sequence, at two
levels:

- Clients hold slots on one timeline: a client's next sequence takes the turn
  ``max(round, its last slot + 1)``, so each round admits at most one sequence of each client,
  and a client of one small call waits for no other client's backlog.
- Which of a client's sequences fills its slot is chosen when the slot comes up, by the same
  rule over the client's calls: a client's new call goes ahead of that client's own backlog.

Within a priority the order is (turn, position); a lower priority value always goes first.
Preempted sequences keep their slot's turn and go first within it. A slot's rank says what
took it: 0, a client with nothing else live; 1, a call with nothing else live; 2, the rest.
When a client's last seated sequence ends while others of it wait, its first waiting slot
becomes rank 0: a client of two overlapping calls is never left behind another's flood.
The scheduler's reserved seats go to ranks 0 and 1, the last of them to rank 0 only. A
sequence without a call is a client of its own: those are FCFS (the offline engine's order),
first slots all.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from warmboot.core.request import Request

Slot = tuple[int, int, int, str, int]
"""A client's place on the timeline: (priority, turn, position, client, rank)."""
Local = tuple[int, int, int, Request]
"""A sequence's place within its client: (priority, call turn, position, request)."""


@dataclass
class Entry:
    """What ``pop`` hands out: a slot and the request chosen to fill it."""

    slot: Slot
    local: Local

    @property
    def req(self) -> Request:
        return self.local[3]


class WaitingQueue:
    """Requests waiting for admission. Slots sit in a heap per rank, so that a step with only
    reserved seats left passes over the others without popping them all; each client's
    requests sit in a heap of their own."""

    def __init__(self) -> None:
        self._slots: tuple[list[Slot], ...] = ([], [], [])
        self._clients: dict[str, list[Local]] = {}
        self._back = itertools.count()
        self._front = itertools.count(-1, -1)

    def append(self, req: Request) -> None:
        """An arrival: behind every request of its priority and turn."""
        self._push(req, next(self._back))

    def appendleft(self, req: Request) -> None:
        """A preempted request: ahead of every request of its priority and turn."""
        self._push(req, next(self._front))

    def _push(self, req: Request, pos: int) -> None:
        prio = req.params.priority
        slot = (prio, req.turn, pos, _client_of(req), req.rank)
        self.restore([Entry(slot, (prio, req.local_turn, pos, req))])

    def pop(self, rank: int = 2) -> Entry | None:
        """The next slot of at most ``rank`` and its client's next request, or None (also when
        a slot of a higher rank and a lower priority value waits: none overtakes it)."""
        heads = [h[0] for h in self._slots if h]
        if not heads:
            return None
        best = min(heads)
        if best[4] > rank:
            allowed = [h for h in heads if h[4] <= rank]
            if not allowed or min(allowed)[0] > best[0]:
                return None
            best = min(allowed)
        return self._fill(heapq.heappop(self._slots[best[4]]))

    def _fill(self, slot: Slot) -> Entry:
        heap = self._clients[slot[3]]
        local = heapq.heappop(heap)
        if not heap:
            del self._clients[slot[3]]
        return Entry(slot, local)

    def restore(self, entries: Iterable[Entry]) -> None:
        """Put popped entries back in their places."""
        for e in entries:
            heapq.heappush(self._slots[e.slot[4]], e.slot)
            heapq.heappush(self._clients.setdefault(e.slot[3], []), e.local)

    def has_rank(self, rank: int) -> bool:
        """Whether a slot of ``rank`` waits."""
        return bool(self._slots[rank])

    def promote(self, client: str) -> None:
        """``client``'s first waiting slot to rank 0 (it has none seated now)."""
        if any(s[3] == client for s in self._slots[0]):
            return
        mine = [s for heap in self._slots[1:] for s in heap if s[3] == client]
        if mine:
            first = min(mine, key=lambda s: s[:3])
            _remove(self._slots[first[4]], lambda s: s is first)
            heapq.heappush(self._slots[0], (*first[:4], 0))

    def remove(self, req: Request) -> None:
        """Take ``req`` out, and with it its client's latest slot."""
        key = _client_of(req)
        _remove(self._clients[key], lambda e: e[3] is req)
        if not self._clients[key]:
            del self._clients[key]
        mine = [s for heap in self._slots for s in heap if s[3] == key]
        latest = max(mine, key=lambda s: s[1:3])
        _remove(self._slots[latest[4]], lambda s: s is latest)

    def __len__(self) -> int:
        return sum(map(len, self._slots))

    def requests(self) -> Iterator[Request]:
        """Every waiting request, in no order."""
        return (e[3] for heap in self._clients.values() for e in heap)

    def __iter__(self) -> Iterator[Request]:
        """In admission order, as far as it is known now (sorts: for stats and tests)."""
        slots = sorted((s for heap in self._slots for s in heap), key=lambda s: s[:3])
        queues = {c: iter(sorted(heap, key=lambda e: e[:3])) for c, heap in self._clients.items()}
        return (next(queues[s[3]])[3] for s in slots)


def _remove(heap: list, match) -> None:
    i = next(i for i, e in enumerate(heap) if match(e))
    last = heap.pop()
    if i < len(heap):
        heap[i] = last
        heapq.heapify(heap)


@dataclass
class _Call:
    last_turn: int
    live: int = 0


@dataclass
class _Client:
    last_slot: int
    round: int = 0
    """The latest call turn admitted."""
    live: int = 0
    seated: int = 0
    calls: dict[str, _Call] = field(default_factory=dict)


class FairTurns:
    """Gives each sequence its slot (``turn``, ``rank``) and its ``local_turn`` among its
    client's calls (see the module docstring); forgets a call, and a client, once none of its
    sequences is left."""

    def __init__(self) -> None:
        self.round = 0
        """The latest slot turn admitted."""
        self._clients: dict[str, _Client] = {}

    def assign(self, req: Request) -> None:
        client = self._clients.setdefault(_client_of(req), _Client(self.round - 1))
        call = client.calls.setdefault(_call_of(req), _Call(client.round - 1))
        req.rank = 0 if not client.live else 1 if not call.live else 2
        req.turn = max(self.round, client.last_slot + 1)
        client.last_slot, client.live = req.turn, client.live + 1
        req.local_turn = max(client.round, call.last_turn + 1)
        call.last_turn, call.live = req.local_turn, call.live + 1

    def clients(self) -> Iterator[str]:
        """The clients with live sequences (API calls only: a bare sequence is none)."""
        return (c for c in self._clients if not c.startswith("\0"))

    def admitted(self, entry: Entry) -> None:
        """``entry``'s request took a seat: it keeps its slot (a preemption returns it)."""
        req = entry.req
        req.turn, req.rank = entry.slot[1], entry.slot[4]
        self.round = max(self.round, req.turn)
        client = self._clients[_client_of(req)]
        client.round = max(client.round, req.local_turn)
        client.seated += 1

    def unseated(self, req: Request) -> None:
        """``req`` was preempted: back to waiting, its slot kept."""
        self._clients[_client_of(req)].seated -= 1

    def release(self, req: Request, seated: bool) -> str | None:
        """``req`` ended (``seated``: it held a seat). Returns its client when that has
        sequences waiting and none seated now (the queue promotes its first slot)."""
        key = _client_of(req)
        client = self._clients.get(key)
        if client is None:
            return None
        client.seated -= seated
        client.live -= 1
        call = client.calls[_call_of(req)]
        call.live -= 1
        if not call.live:
            del client.calls[_call_of(req)]
        if not client.live:
            del self._clients[key]
            return None
        return key if seated and not client.seated else None


def _client_of(req: Request) -> str:
    return req.client if req.group is not None else f"\0{req.request_id}"


def _call_of(req: Request) -> str:
    return req.group if req.group is not None else ""
