"""Continuous-batching scheduler: fair queuing within priorities, chunked prefill under a token
budget, prefill and decode mixed in one step, preemption by recompute. Pure Python; talks to
the runner in plain data.

Fairness (``core.fair_queue``): clients take turns, then each client's calls.

- Round robin: within a priority, one sequence of each client per round, then by arrival.
- Reserved seats: only a client's or a call's first live sequence may take the last
  ``reserved_seats``, and only a client's the last half of them.
- Long prefills are chunked: one request computes at most ``prefill_chunk`` tokens a step,
  and first leaves what the running requests behind it claim (a decode its token, a prompt
  this step can finish its rest): a small prompt admitted behind it is done in one step.
- Prompt-logprob tokens (an LM head over the vocabulary each) weigh more in the step budget
  and the chunk cap (``prompt_logprob_token_weight``, learnt with ``max_step_ms``), and so,
  time-capped, does a prefill token for the earlier KV it reads (``StepCost.read_weight``).
- With ``max_step_ms``, a step holds what the fitted step cost (``core.step_cost``) says fits
  in that time (or in twice its unavoidable cost, if longer), never less than its decodes
  plus ``MIN_PREFILL_UNITS`` for running prefills, and as much again that they leave to
  waiting requests while one could take a free seat (while shared: the one for both).
- Express steps (time-capped only): when the running requests would make a step long, a new
  client's small prompt runs in a short step of its own, never two of those in a row.
- Shared steps (time-capped only, ``core.shared_steps``): while several clients are present,
  steps are a few one-row steps long, their decodes cut to fit (served longest ago first).
- LoRA: running requests use at most ``max_loras`` adapters; one needing another may be passed.

Bound: a new client's first sequence is admitted in the first step scheduled after it arrives
that has, once the requests ahead of it are served (preempted requests, lower priority values
and at most one sequence of each other client), a free seat, KV blocks and budget for its
first chunk. Beside one client's load of any shape (256 streams, a 1000-prompt call, a
prompt near ``max_model_len``, echo + prompt_logprobs + n=16), that is the next step: the sync
loop returns its first token from the next ``step()``, the pipelined loop (two steps in flight)
from the third; with ``max_step_ms`` each of those steps lasts about that long at most.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

from warmboot.config import SchedulerConfig
from warmboot.core.block_manager import BlockManager
from warmboot.core.fair_queue import Entry, FairTurns, WaitingQueue
from warmboot.core.request import FinishReason, Request, RequestStatus, lora_full
from warmboot.core.shared_steps import MIN_UNITS, SharedSteps, shared_cut
from warmboot.core.state_prefix import KVPrefix
from warmboot.core.step_cost import MIN_SAMPLES, StepCost
from warmboot.core.step_load import claims_behind, running_load
from warmboot.core.types import RunnerOutput, ScheduledRequest, SchedulerOutput, TokenEvent

MIN_PREFILL_UNITS = 32
"""Prefill budget a time-capped step always has beside its decodes, and that running prefills
leave to waiting requests: a small request's prompt in one chunk."""
EXPRESS_UNITS = 2 * MIN_PREFILL_UNITS
"""Most prefill units of an express step: new clients' whole prompts, alone (``_express``)."""
EXPRESS_GAIN = 1.5
"""An express step runs when the step it spares a new client lasts this many times as long."""


def _priority(req: Request) -> int:
    return req.params.priority


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: BlockManager, prefix: KVPrefix | None = None):
        self.config, self.kv = config, kv
        self.prefix = prefix or KVPrefix(kv)
        """Prefix lookups (``core.state_prefix``: with states kept for state layers)."""
        self.waiting = WaitingQueue()
        self.turns = FairTurns()
        self.step_cost = StepCost(config.prompt_logprob_token_weight, bool(config.max_step_ms))
        """Fed by the loop as steps retire (``max_step_ms``)."""
        self.running: list[Request] = []
        """Ordered by priority, then admission: the step serves it in order and preempts
        from its end."""
        self.requests: dict[str, Request] = {}
        self._finished_since_step: list[str] = []
        self.num_preemptions = 0
        self.num_express = 0
        self._expressed = False
        self.shared = SharedSteps(self.running)
        self._shared, self._skip = False, set()  # NOTE: _skip: decodes left to the next step

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
        self._shared = bool(self.config.max_step_ms) and self.shared.note(self.turns.clients())
        self._expressed = not self._expressed and self._express(out)
        if self._expressed:
            return out
        budget, reserve = self._budget()
        left = self._schedule_running(out, budget, reserve)
        if not out.preempted_req_ids:
            left = self._schedule_waiting(out, left)
        out.budget_units = budget - left
        return out

    def _budget(self) -> tuple[float, float]:
        """(the step's budget, the part of it running prefills leave to waiting requests)."""
        cfg, self._skip = self.config, set()
        if not cfg.max_step_ms or self.step_cost.samples < MIN_SAMPLES:
            return cfg.max_num_batched_tokens, 0
        decodes, context, prefills = running_load(self.running, self._weight)
        seconds = cfg.max_step_ms / 1000
        if self._shared:  # NOTE: decodes cut to fit a shared step, never to a shorter cap
            cut = shared_cut(self.step_cost.fit(), self.running, decodes, context)
            shared, self._skip, decodes, context = cut
            seconds = min(seconds, shared)
        cap = self.step_cost.units_within(seconds, decodes, context, stretch=not self._shared)
        least = MIN_UNITS if self._shared else MIN_PREFILL_UNITS  # NOTE: shared: 16 units...
        newcomer = not self._shared or self.waiting.has_rank(0)  # NOTE: ...a newcomer's 32
        reserve = (MIN_PREFILL_UNITS if newcomer else least) if self._admissible_waits() else 0
        own = MIN_PREFILL_UNITS * (prefills > 0 and not self._shared)  # NOTE: shared: one for all
        floor = decodes + max(own + reserve, least)
        budget = min(cfg.max_num_batched_tokens, max(cap, floor))
        return budget, max(0, min(reserve, budget - decodes - 1))  # NOTE: a prefill moves

    def _admissible_waits(self) -> bool:
        """Whether a waiting request could take a seat now (siblings wait for their leader)."""
        if len(self.running) >= self.config.max_num_seqs:
            return False
        return any(not self._held(r) for r in self.waiting.requests())

    def _held(self, req: Request) -> bool:
        """It waits for its leader's prompt KV, or for a free adapter slot (``max_loras``)."""
        return req.waits_for_leader(self.kv.enable_prefix_caching) or lora_full(
            self.running, self.config.max_loras, req
        )

    def _weight(self, req: Request, start: int | None = None) -> float:
        """Budget units a token of ``req``'s chunk from ``start`` counts (module docstring)."""
        weight = self.step_cost.logprob_weight if req.wants_prompt_logprobs else 1.0
        start = req.num_computed_tokens if start is None else start
        return weight + (self.step_cost.read_weight(start) if self.config.max_step_ms else 0.0)

    def _chunk(
        self, req: Request, remaining: int, budget: float, start: int | None = None
    ) -> tuple[int, float]:
        """How many of its ``remaining`` tokens ``req`` computes in this step (at most the
        chunk cap, at least one) and the budget they use (``_weight`` each)."""
        cfg, weight = self.config, self._weight(req, start)
        n = min(remaining, max(1, int(min(budget, cfg.prefill_chunk) / weight)), int(budget))
        return n, n * weight

    def _schedule_running(self, out: SchedulerOutput, budget: float, reserve: float) -> float:
        claims = budget >= 4 * MIN_PREFILL_UNITS  # NOTE: a tiny budget is served in order
        left = self._serve_running(out, budget, reserve, claims)
        if claims and not out.scheduled and not out.preempted_req_ids:
            left = self._serve_running(out, budget, reserve, claims=False)  # claims unserved
        return left

    def _serve_running(
        self, out: SchedulerOutput, budget: float, reserve: float, claims: bool
    ) -> float:
        incoming = 0  # blocks that preempted victims return when the in-flight step retires
        full, behind = budget, None  # NOTE: claims are summed at the first prefill, if any
        i = 0
        while i < len(self.running) and budget >= 1:
            req = self.running[i]
            remaining = req.num_tokens - req.num_computed_tokens
            own = budget
            if remaining > 1:  # NOTE: prefills leave the reserve and the claims behind them
                if claims and behind is None:
                    behind = claims_behind(
                        self.running, full, self._weight, MIN_PREFILL_UNITS, self._skip
                    )
                own -= reserve + (behind[i] if behind is not None else 0.0)
            if req.num_planned_outputs >= req.max_tokens or own < 1 or req in self._skip:
                i += 1  # NOTE: its last token is in flight; never launch a row past max_tokens
                continue
            n, cost = self._chunk(req, remaining, own)
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

    def _schedule_waiting(self, out: SchedulerOutput, budget: float) -> float:
        skipped: list[Entry] = []
        anyone, firsts = self.config.seat_ranks
        while budget >= 1 and len(self.running) < self.config.max_num_seqs:
            seated = len(self.running)
            entry = self.waiting.pop(rank=2 if seated < anyone else 1 if seated < firsts else 0)
            if entry is None:
                break
            if self._held(entry.req):
                skipped.append(entry)
                continue
            cost = self._admit(entry, out, budget)
            if cost is None:
                skipped.append(entry)  # NOTE: the head waits for blocks: none overtakes it
                break
            budget -= cost
        self.waiting.restore(skipped)
        return budget

    def _admit(
        self, entry: Entry, out: SchedulerOutput, budget: float, whole: bool = False
    ) -> float | None:
        """Seat ``entry``'s request with its first chunk (``whole``: only if that is its whole
        prompt); the budget it used, or None (no blocks, or not whole)."""
        req = entry.req
        cold = req.num_computed_tokens or req.wants_prompt_logprobs
        prefix = [] if cold else self.prefix.find(req)
        start = len(prefix) * self.kv.block_size  # NOTE: a cached prefix is read, not free
        n, cost = self._chunk(req, req.num_tokens - start, budget, start)
        if (whole and start + n < req.num_tokens) or (cost > budget and out.scheduled):
            return None
        if not self.kv.allocate(req.request_id, start + n, prefix):
            return None
        if req.num_preemptions == 0:
            req.num_cached_tokens = start
        req.num_computed_tokens = start
        req.status = RequestStatus.RUNNING
        self.turns.admitted(entry)
        bisect.insort(self.running, req, key=_priority)  # NOTE: all equal: an append
        out.scheduled.append(self._scheduled(req, n))
        return cost

    def _express(self, out: SchedulerOutput) -> bool:
        """A step of new clients' small prompts alone (rank 0: a client with nothing else
        live), when the step they would share with the running requests would last
        ``EXPRESS_GAIN`` times as long as this one: beside 62 decoding streams a new client's
        first token then waits for the step in flight and a short one, not for a long one
        more. Time-capped schedulers only, never two in a row: the running requests lose
        at most every other step, each the length of the short one."""
        cfg, fit = self.config, self.step_cost.fit()
        if not (cfg.max_step_ms and fit and self.running and self.waiting.has_rank(0)):
            return False
        fixed, per_unit, per_row, per_read = fit
        decodes, context, prefill = running_load(self.running, self._weight)
        budget = self._budget()[0]  # NOTE: and the decodes a shared step leaves out
        kept = decodes - len(self._skip)
        decodes, context = kept, context * kept // max(decodes, 1)
        prefill = min(prefill, budget - decodes)  # NOTE: what the step would hold
        shared = fixed + per_row * decodes + per_read * context + per_unit * prefill
        budget, skipped = float(EXPRESS_UNITS), []
        while budget >= 1 and len(self.running) < cfg.max_num_seqs:
            entry = self.waiting.pop(rank=0)
            if entry is None:
                break
            skipped.append(entry)
            units = self._chunk(entry.req, entry.req.num_tokens, budget)[1]
            alone = fixed + per_unit * (EXPRESS_UNITS - budget + units)
            gain = (shared + per_unit * units) / alone
            if gain < EXPRESS_GAIN or self._held(entry.req):
                break
            cost = self._admit(entry, out, budget, whole=True)
            if cost is None:
                break
            skipped.pop()
            budget -= cost
        self.waiting.restore(skipped)
        out.budget_units = EXPRESS_UNITS - budget
        self.num_express += bool(out.scheduled)
        return bool(out.scheduled)

    def _scheduled(self, req: Request, n: int) -> ScheduledRequest:
        start = req.num_computed_tokens
        sample = start + n == req.num_tokens
        token_ids = req.all_token_ids[start : start + n]
        device_fed = len(token_ids) < n
        if device_fed:  # NOTE: only the newest token can be unknown to the host
            assert req.num_inflight == 1 and len(token_ids) == n - 1
            token_ids.append(-1)
        lp_from, targets = 0, ()
        if req.params.prompt_logprobs is not None:  # NOTE: inline test: a step builds 100s
            lp_from, targets = req.take_prompt_logprob_targets(start, n)
        suppress = req.suppressed_tokens(sample)
        states = self.prefix.plan(req, start, n)  # NOTE: before the counts move on
        req.num_computed_tokens += n
        req.num_inflight += sample
        req.served_at = self.shared.step
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
            lora=req.lora,
            **states,
        )

    def _preempt(self, req: Request) -> None:
        self.turns.unseated(req)
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    # -- update --------------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, result: RunnerOutput) -> list[TokenEvent]:
        """Commit a step: append its sampled tokens, check token stops, cache what it computed."""
        rows = {rid: i for i, rid in enumerate(result.req_ids)}
        events = []
        for s in out.scheduled:
            req = self.requests.get(s.req_id)
            if req is None:
                continue  # finished while the step ran: a zombie row, its token is dropped
            self.prefix.computed(req, s)  # NOTE: before a stop frees its blocks
            prompt_lps = result.prompt_logprobs.get(s.req_id)
            if prompt_lps is not None and not s.sample:
                events.append(TokenEvent(req.request_id, [], [], prompt_logprobs=prompt_lps))
            if s.sample:
                events.append(self._sampled(req, result, rows[s.req_id], prompt_lps))
        return events

    def _sampled(self, req: Request, result: RunnerOutput, row: int, prompt_lps) -> TokenEvent:
        """Append ``row``'s sampled token to ``req``, finishing it if the token stops it."""
        token = result.sampled_token_ids[row]
        req.append_output(token)
        reason = req.stop_after(token)
        if reason is not None:
            self._remove(req)
            self._finish(req, reason)
        logprobs = result.logprobs[row] if result.logprobs else None
        return TokenEvent(req.request_id, [token], [logprobs], reason, req.stop_reason, prompt_lps)

    def _remove(self, req: Request) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)  # preempted while its last step was in flight

    def _finish(self, req: Request, reason: FinishReason) -> None:
        seated = req.status is RequestStatus.RUNNING
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        waiting_client = self.turns.release(req, seated)
        if waiting_client is not None:
            self.waiting.promote(waiting_client)
        self.kv.free(req.request_id)
        self.prefix.forget(req)
        self._finished_since_step.append(req.request_id)
        del self.requests[req.request_id]
