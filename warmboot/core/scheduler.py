"""Continuous-batching scheduler: fair queuing within priorities, chunked prefill under a token
budget, prefill and decode mixed in one step, preemption by recompute. Pure Python; talks to
the runner in plain data.

Fairness policy (per call). A call is one API request (``Request.group``: the server passes
its id; every prompt and completion of it is one sequence). Not per client: behind one API key
or a proxy the server cannot tell clients apart, while a call is what a client waits on.

- Round robin between calls: within a priority the queue is ordered by turn, then arrival.
  A call's sequences take consecutive turns from the round being served when it arrives
  (start-time fair queuing, one unit a sequence): each round admits at most one sequence of
  each call, so a new call waits for neither the backlog of a big one nor, as a flood of
  new calls, starves it. Preempted requests keep their turn and go first within it. A lower
  priority value always goes first.
- Reserved seats: a call's later sequences never take the last ``reserved_seats`` seats.
- Long prefills are chunked: one request computes at most ``prefill_chunk`` tokens a step.
- Prompt-logprob tokens (an LM head over the vocabulary each) count
  ``prompt_logprob_token_weight`` times against the step budget and the chunk cap.

Bound: a new call's first sequence is admitted in the first step scheduled after it
arrives that has, once the requests ahead of it are served (preempted requests, lower priority
values and at most one sequence of each other call), a free seat, KV blocks and budget for its
first chunk; the budget running requests take is their decodes plus at most
``prefill_chunk`` (weighted) tokens per prefill, and a call's later sequences never take the
reserved seats. Beside one call of any size (a 1000-prompt call, a prompt near
``max_model_len``, echo + prompt_logprobs + n=16) with default settings, that is the next
step: the sync loop returns its first token from the next ``step()``, the pipelined loop
(two steps in flight) from the third. Requests without a group are admitted FCFS.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from warmboot.config import SchedulerConfig
from warmboot.core.block_manager import BlockManager
from warmboot.core.request import FinishReason, Request, RequestStatus
from warmboot.core.types import RunnerOutput, ScheduledRequest, SchedulerOutput, TokenEvent

Entry = tuple[int, int, int, Request]
"""A waiting request's place: (priority, turn, position, request)."""


def _priority(req: Request) -> int:
    return req.params.priority


class WaitingQueue:
    """Requests waiting for admission in (priority, turn, position) order: lower priority
    values first, then earlier turns; within one turn, preempted requests (newest preemption
    first) and then arrivals in order. Without groups every turn is the round at arrival,
    which keeps the FCFS order.

    Two heaps, calls' first sequences and their later ones, so that a step with only
    reserved seats left passes over the later ones without popping them all."""

    def __init__(self) -> None:
        self._heaps: tuple[list[Entry], list[Entry]] = ([], [])
        self._back = itertools.count()
        self._front = itertools.count(-1, -1)

    def append(self, req: Request) -> None:
        """An arrival: behind every request of its priority and turn."""
        self._push((req.params.priority, req.turn, next(self._back), req))

    def appendleft(self, req: Request) -> None:
        """A preempted request: ahead of every request of its priority and turn."""
        self._push((req.params.priority, req.turn, next(self._front), req))

    def _push(self, entry: Entry) -> None:
        heapq.heappush(self._heaps[entry[3].rank > 0], entry)

    def pop(self, later: bool = True) -> Entry | None:
        """The next request, or None. ``later=False``: the next first sequence of a call,
        unless a later sequence of a lower priority value waits (none overtakes that)."""
        first, rest = self._heaps
        if rest and (not first or rest[0] < first[0]):
            if later:
                return heapq.heappop(rest)
            if not first or rest[0][0] < first[0][0]:
                return None
        return heapq.heappop(first) if first else None

    def restore(self, entries: Iterable[Entry]) -> None:
        """Put popped entries back in their places."""
        for entry in entries:
            self._push(entry)

    def remove(self, req: Request) -> None:
        heap = self._heaps[req.rank > 0]
        i = next(i for i, e in enumerate(heap) if e[3] is req)
        last = heap.pop()
        if i < len(heap):
            heap[i] = last
            heapq.heapify(heap)

    def __len__(self) -> int:
        return len(self._heaps[0]) + len(self._heaps[1])

    def __iter__(self) -> Iterator[Request]:
        """In admission order (sorts: for stats and tests, not for the step)."""
        return (e[3] for e in sorted(self._heaps[0] + self._heaps[1], key=lambda e: e[:3]))


@dataclass
class _Call:
    last_turn: int
    sequences: int = 0
    live: int = 0


class FairTurns:
    """Gives each sequence its ``rank`` and ``turn`` (see the module docstring); forgets a
    call once none of its sequences is left."""

    def __init__(self) -> None:
        self.round = 0
        """The latest turn admitted."""
        self._calls: dict[str, _Call] = {}

    def assign(self, req: Request) -> None:
        if req.group is None:
            req.rank, req.turn = 0, self.round
            return
        call = self._calls.setdefault(req.group, _Call(self.round - 1))
        req.rank, req.turn = call.sequences, max(self.round, call.last_turn + 1)
        call.last_turn, call.sequences, call.live = req.turn, call.sequences + 1, call.live + 1

    def admitted(self, req: Request) -> None:
        self.round = max(self.round, req.turn)

    def release(self, req: Request) -> None:
        call = self._calls.get(req.group) if req.group is not None else None
        if call is not None:
            call.live -= 1
            if not call.live:
                del self._calls[req.group]


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: BlockManager):
        self.config = config
        self.kv = kv
        self.waiting = WaitingQueue()
        self.turns = FairTurns()
        self.running: list[Request] = []
        """Ordered by priority, then admission: the step serves it in order and preempts
        from its end."""
        self.requests: dict[str, Request] = {}
        self._finished_since_step: list[str] = []
        self.num_preemptions = 0

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self.turns.assign(req)
        self.waiting.append(req)

    @property
    def finished_since_step(self) -> tuple[str, ...]:
        """Requests finished since the last ``schedule()`` (the next one tells the runner)."""
        return tuple(self._finished_since_step)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish_requests(self, req_ids: Iterable[str], reason: FinishReason) -> None:
        """Finish requests from outside the step (abort, stop string)."""
        for req_id in req_ids:
            req = self.requests.get(req_id)
            if req is None or req.is_finished:
                continue
            self._remove(req)
            self._finish(req, reason)

    # -- schedule ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._finished_since_step)
        self._finished_since_step = []
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted_req_ids:
            self._schedule_waiting(out, budget)
        return out

    def _chunk(self, req: Request, remaining: int, budget: float) -> tuple[int, float]:
        """How many of its ``remaining`` tokens ``req`` computes in this step (at most the
        chunk cap, at least one) and the budget they use (prompt-logprob tokens weigh more)."""
        cfg = self.config
        weight = cfg.prompt_logprob_token_weight if req.wants_prompt_logprobs else 1.0
        n = min(remaining, max(1, int(min(budget, cfg.prefill_chunk) / weight)), int(budget))
        return n, n * weight

    def _schedule_running(self, out: SchedulerOutput, budget: float) -> float:
        incoming = 0  # blocks that preempted victims return when the in-flight step retires
        i = 0
        while i < len(self.running) and budget >= 1:
            req = self.running[i]
            if req.num_planned_outputs >= req.max_tokens:
                i += 1  # NOTE: its last token is in flight; never launch a row past max_tokens
                continue
            n, cost = self._chunk(req, req.num_tokens - req.num_computed_tokens, budget)
            room, incoming = self._make_room(req, n, out, incoming)
            if not room:
                if req.status is not RequestStatus.RUNNING:
                    return budget  # req preempted itself
                i += 1  # its blocks come when the in-flight step retires: it sits this step out
                continue
            out.scheduled.append(self._scheduled(req, n))
            budget -= cost
            i += 1
        return budget

    def _make_room(
        self, req: Request, n: int, out: SchedulerOutput, incoming: int
    ) -> tuple[bool, int]:
        """Allocate for ``n`` more tokens of ``req``, preempting as needed from the end of
        ``running``: the lowest priority, most recently admitted first. Those come after
        ``req`` in the step's order, so none of them was scheduled in this step.

        NOTE: in the pipelined loop a victim's blocks are held by the in-flight step and return
        only when it retires. Blocks already on their way count as room: the requester then sits
        this step out instead of preempting more (one missing block must not empty the batch).
        """
        table = self.kv.block_table(req.request_id)
        need = self.kv.blocks_needed(req.num_computed_tokens + n) - len(table)
        if need <= 0 and table:
            return True, incoming  # NOTE: most decode steps: the last block has room
        while not self.kv.allocate(req.request_id, req.num_computed_tokens + n):
            if need <= self.kv.num_free_blocks + incoming:
                return False, incoming - max(0, need - self.kv.num_free_blocks)
            held_before = self.kv.num_held_only_blocks
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted_req_ids.append(victim.request_id)
            incoming += self.kv.num_held_only_blocks - held_before
            if victim is req:
                return False, incoming
        return True, incoming

    def _schedule_waiting(self, out: SchedulerOutput, budget: float) -> None:
        skipped: list[Entry] = []
        while budget >= 1 and len(self.running) < self.config.max_num_seqs:
            entry = self.waiting.pop(later=len(self.running) < self.config.fair_seats)
            if entry is None:
                break
            req = entry[3]
            if self._waits_for_leader(req):
                skipped.append(entry)
                continue
            cold = req.num_computed_tokens or req.wants_prompt_logprobs
            prefix = [] if cold else self.kv.find_cached_prefix(req.all_token_ids)
            start = len(prefix) * self.kv.block_size
            n, cost = self._chunk(req, req.num_tokens - start, budget)
            if not self.kv.allocate(req.request_id, start + n, prefix):
                skipped.append(entry)  # NOTE: the head waits for blocks: none overtakes it
                break
            if req.num_preemptions == 0:
                req.num_cached_tokens = start
            req.num_computed_tokens = start
            req.status = RequestStatus.RUNNING
            self.turns.admitted(req)
            bisect.insort(self.running, req, key=_priority)  # NOTE: all equal: an append
            out.scheduled.append(self._scheduled(req, n))
            budget -= cost
        self.waiting.restore(skipped)

    def _waits_for_leader(self, req: Request) -> bool:
        # n > 1: siblings wait until the leader's first token is committed; by then its prompt's
        # full blocks are in the prefix cache and the siblings share them.
        leader = req.leader
        return (
            leader is not None
            and self.kv.enable_prefix_caching
            and not leader.is_finished
            and leader.num_output_tokens == 0
        )

    def _scheduled(self, req: Request, n: int) -> ScheduledRequest:
        start = req.num_computed_tokens
        sample = start + n == req.num_tokens
        token_ids = req.all_token_ids[start : start + n]
        device_fed = len(token_ids) < n
        if device_fed:  # NOTE: only the newest token can be unknown to the host
            assert req.num_inflight == 1 and len(token_ids) == n - 1
            token_ids.append(-1)
        suppress: tuple[int, ...] = ()
        if sample and req.num_planned_outputs < req.params.min_tokens:
            eos = () if req.params.ignore_eos else tuple(req.eos_token_ids)
            suppress = eos + req.params.stop_token_ids
        lp_from, targets = 0, ()
        if req.params.prompt_logprobs is not None:  # NOTE: inline test: a step builds 100s
            lp_from, targets = self._prompt_logprob_targets(req, start, n)
        req.num_computed_tokens += n
        req.num_inflight += sample
        return ScheduledRequest(
            req_id=req.request_id,
            token_ids=token_ids,
            start_pos=start,
            block_table=list(self.kv.block_table(req.request_id)),
            sample=sample,
            params=req.params,
            prompt_token_ids=req.prompt_token_ids,
            suppress_token_ids=suppress,
            device_fed=device_fed,
            prompt_logprobs_from=lp_from,
            prompt_logprob_targets=targets,
        )

    @staticmethod
    def _prompt_logprob_targets(req: Request, start: int, n: int) -> tuple[int, tuple[int, ...]]:
        """The prompt tokens a chunk at ``start..start+n`` predicts that no earlier step was
        asked for: position ``p`` predicts prompt token ``p + 1``."""
        if not req.wants_prompt_logprobs:
            return 0, ()
        first = max(start + 1, req.num_prompt_logprobs + 1)  # the first target token's index
        last = min(start + n, req.num_prompt_tokens - 1)
        if last < first:
            return 0, ()
        req.num_prompt_logprobs = last
        return first - 1 - start, tuple(req.prompt_token_ids[first : last + 1])

    def _preempt(self, req: Request) -> None:
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    # -- update --------------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, result: RunnerOutput) -> list[TokenEvent]:
        """Commit a step: append its sampled tokens, check token stops, cache full blocks."""
        rows = {rid: i for i, rid in enumerate(result.req_ids)}
        events = []
        for s in out.scheduled:
            req = self.requests.get(s.req_id)
            if req is None:
                continue  # finished while the step ran: a zombie row, its token is dropped
            prompt_lps = result.prompt_logprobs.get(s.req_id)
            if prompt_lps is not None and not s.sample:
                events.append(TokenEvent(req.request_id, [], [], prompt_logprobs=prompt_lps))
            if s.sample:
                row = rows[s.req_id]
                token = result.sampled_token_ids[row]
                req.append_output(token)
                reason = self._check_stop(req, token)
                if reason is not None:
                    self._remove(req)
                    self._finish(req, reason)
                logprobs = result.logprobs[row] if result.logprobs else None
                events.append(
                    TokenEvent(req.request_id, [token], [logprobs], reason, req.stop_reason,
                               prompt_logprobs=prompt_lps)
                )  # fmt: skip
            if req.status is RequestStatus.RUNNING:
                known = min(req.num_computed_tokens, req.num_known_tokens)
                self.kv.cache_full_blocks(req.request_id, req.all_token_ids, known)
        return events

    def _check_stop(self, req: Request, token: int) -> FinishReason | None:
        p = req.params
        if req.num_output_tokens > p.min_tokens:  # earlier stops were suppressed by the sampler
            if not p.ignore_eos and token in req.eos_token_ids:
                return FinishReason.STOP
            if token in p.stop_token_ids:
                req.stop_reason = token
                return FinishReason.STOP
        if req.num_output_tokens >= req.max_tokens:
            return FinishReason.LENGTH
        return None

    def _remove(self, req: Request) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)  # preempted while its last step was in flight

    def _finish(self, req: Request, reason: FinishReason) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.turns.release(req)
        self.kv.free(req.request_id)
        self._finished_since_step.append(req.request_id)
        del self.requests[req.request_id]
