"""The model runner owns every device tensor (weights, KV cache, per-request token slots and
generators) and turns a ``SchedulerOutput`` into a ``RunnerOutput`` in calls that the loops
order: ``prepare_step`` + ``submit_forward``, ``launch_sample``, ``collect``; committed tokens
come back through ``record_tokens``. Per request: a slot (``slots``), sampling state."""

from __future__ import annotations

import weakref
from collections import Counter
from pathlib import Path

import torch

from warmboot.config import ModelConfig
from warmboot.core.types import RunnerOutput, ScheduledRequest, SchedulerOutput, TokenEvent
from warmboot.device.compiled import CompiledSteps, CompileStats
from warmboot.device.graphs import DecodeGraphs
from warmboot.device.inputs import InputBuilder
from warmboot.device.pools import Pools, keep_states, prepare_states
from warmboot.device.sampler import Sampler, prompt_logprobs
from warmboot.device.sampling_state import SamplingState
from warmboot.device.slots import RequestSlots
from warmboot.device.staging import StepHandle, upload
from warmboot.device.streams import make_stream
from warmboot.device.threads import torch_threads
from warmboot.kernels.backend import AttentionBackend, AttentionSpec, KVLayout
from warmboot.kernels.step_ops import StepContext
from warmboot.lora.registry import step_lora
from warmboot.models.base import CausalLM
from warmboot.models.loader import assemble_model, load_model


class ModelRunner:
    def __init__(
        self,
        model_cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        attention: AttentionBackend,
        block_size: int,
        num_request_slots: int,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        cpu_threads: int | None = None,
    ):
        self.model_cfg, self.dtype, self.device = model_cfg, dtype, device
        self.attention, self.block_size = attention, block_size
        self.model: CausalLM | None = None
        self.specs: list[AttentionSpec] = []
        """The model's per-layer attention facts (read once, not per step)."""
        self.kv_layout: KVLayout | None = None
        """What the model's KV cache holds per token and layer (``CausalLM.kv_layout``)."""
        self.max_model_len = max_model_len
        self.kv_caches: list[tuple[torch.Tensor, ...] | None] = []
        self.state_caches: list[dict[str, torch.Tensor] | None] = []
        """Per layer: K and V pages, or a state layer's tensors (``device.pools``: a row per
        request slot, the warm-ups' ``scratch_state_slot``, then ``checkpoint_rows``)."""
        self.pools = Pools(device, dtype)
        self.sampler = Sampler()
        self.cpu_threads = cpu_threads
        self.stream = make_stream(device, cpu_threads)
        weakref.finalize(self, self.stream.close)
        self.sampling_state = SamplingState(device)  # NOTE: seeded generators, penalty histories
        self._handles: list[StepHandle | None] = [None, None]
        """The step that last used each ping-pong working set."""
        self._step_count = 0
        self.token_buffer = torch.zeros(num_request_slots, dtype=torch.int64, device=device)
        """Per request slot: the last sampled token (written by sample, read by forward)."""
        self.slots = RequestSlots(num_request_slots)
        self.scratch_state_slot, self.checkpoint_rows = num_request_slots, range(0)
        self._finished: set[str] = set()
        """Finished requests whose slot is still used by an in-flight (zombie) row."""
        tokens = max(max_num_batched_tokens, max_num_seqs)
        self.inputs = InputBuilder(
            block_size, num_request_slots, max_model_len, tokens, max_num_seqs, device
        )
        self.graphs: DecodeGraphs | None = None
        self.compiled: CompiledSteps | None = None
        self.served: Counter[str] = Counter()
        """Steps run per kind: ``compiled``, ``eager`` or ``graph`` (a CUDA graph replay)."""

    # -- start-up phases -----------------------------------------------------------------------
    def load_model(self, model_dir: str | Path, progress=None, quantization=None) -> None:
        """``progress(n)``: the bytes of each checkpoint tensor read; ``quantization``:
        ``LLM``'s (see ``load_model``)."""
        cfg, dtype, device, positions = self.model_cfg, self.dtype, self.device, self.max_model_len
        self.model = load_model(model_dir, cfg, dtype, device, positions, progress, quantization)
        self._adopt_model()

    def install_weights(self, tensors: dict[str, torch.Tensor], source: str, quantization=None):
        """Use weights that are already transformed (a snapshot's ``named_parameters``)."""
        args = (tensors.items(), self.dtype, self.device, self.max_model_len, source, quantization)
        self.model = assemble_model(self.model_cfg, *args)
        self._adopt_model()

    def _adopt_model(self) -> None:
        """Read the new model's attention facts and KV layout (the backend may refuse it)."""
        self.specs = self.model.attention_specs()
        self.kv_layout = self.model.kv_layout()
        self.attention.check_layout(self.kv_layout, self.model_cfg.num_heads)
        self.inputs.adopt(self.model, self.kv_layout)
        self._settle()

    def kv_bytes_per_token(self) -> int:
        """KV cache bytes one token takes across the attention layers (``KVLayout``)."""
        layers = self.kv_layout.num_attention_layers(self.model_cfg.num_layers)
        return layers * self.kv_layout.bytes_per_token(self.dtype.itemsize)

    def state_stats(self) -> dict[str, int]:
        """State slots (one per request slot: live requests and those a step in flight still
        writes), the bytes one request keeps at any context length, and checkpoint rows."""
        has = self.kv_layout.has_state
        return dict(
            state_slots_total=self.slots.num_slots if has else 0,
            state_slots_used=len(self.slots.live) if has else 0,
            state_bytes_per_request=self.kv_layout.state_bytes(self.dtype.itemsize),
            state_checkpoints_total=len(self.checkpoint_rows),
        )

    def kv_bytes_per_block(self) -> int:
        return self.block_size * self.kv_bytes_per_token()

    def pretune_attention(self, max_q: int, max_k: int) -> int:
        """Tune the attention backend's prefill for every shape bucket (start-up, idle)."""
        specs = [s for s in self.specs if s is not None]
        if not specs:
            return 0
        k_cache, v_cache = next(kv for kv in self.kv_caches if kv is not None)[:2]
        windows = {s.tuning_key for s in specs}
        heads = self.model_cfg.num_heads
        return self.attention.pretune(
            k_cache, v_cache, heads, specs[0].scale, windows, max_q, max_k
        )

    def allocate_kv_cache(self, num_blocks: int, checkpoints: int = 0) -> None:
        """``num_blocks`` for the block manager plus the scratch block, and state rows for
        ``checkpoints`` states kept for the prefix cache (idle runner only)."""
        self.kv_caches, self.state_caches = [], []  # NOTE: drop the old pools first
        self.pools.release()
        self.inputs.reset_tables(scratch_block=num_blocks)
        layout, layers = self.kv_layout, self.model_cfg.num_layers
        self.kv_caches = self.pools.kv(layout, layers, num_blocks + 1, self.block_size)
        first = self.scratch_state_slot + 1
        self.checkpoint_rows = range(first, first + checkpoints)
        self.state_caches = self.pools.states(layout, first + checkpoints)
        if self.compiled is not None:  # NOTE: the graphs look the caches up per step
            self.compiled.kv_caches = self.kv_caches
            self.compiled.state_caches = self.state_caches
        self._settle()

    def _settle(self) -> None:
        """Wait for start-up work queued on the default stream (weight copies, zero fills):
        the loops run on their own stream, which does not wait for it."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        """Stop the device thread (after the work queued on it) and drop the weights, the KV
        pool, compiled steps and graphs; the runner cannot step afterwards. Idempotent."""
        self.stream.close(wait=True)
        self.graphs = self.compiled = self.model = None
        self.kv_caches, self.state_caches = [], []
        self.pools.release()
        self.sampling_state.clear()

    def setup_compiled(self, kernel: str = "native") -> CompileStats:
        """Compile the model steps (after the weights and the KV pool; again after either
        changes): every later forward runs the compiled graphs. ``kernel``: the bf16 GEMM."""
        self.compiled = None
        steps = self.build_compiled(kernel)
        self.install_compiled(steps)
        return steps.stats

    def build_compiled(self, kernel: str = "native") -> CompiledSteps:
        """Compiled and warmed steps, not yet the ones that serve (``install_compiled``)."""
        steps = CompiledSteps(
            self.model, self.kv_caches, self.attention, self.dtype, self.cpu_threads, kernel
        )
        steps.state_caches = self.state_caches
        steps.warm_up(self.scratch_block, self.block_size, self.scratch_state_slot)
        return steps

    def install_compiled(self, steps: CompiledSteps | None) -> None:
        """Serve with ``steps`` from the next step on (None: eager)."""
        if steps is not None:  # NOTE: the pools may have been reallocated
            steps.kv_caches, steps.state_caches = self.kv_caches, self.state_caches
        self.compiled = steps

    def _forward_fns(self):
        """(hidden, logits) functions of a step: the compiled graphs when set up."""
        if self.compiled is not None:
            return self.compiled.hidden, self.compiled.logits
        model, kv, attention, specs = self.model, self.kv_caches, self.attention, self.specs
        states = self.state_caches

        def hidden(ids, positions, meta):
            return model(ids, positions, StepContext(attention, kv, meta, specs, states=states))

        return hidden, model.compute_logits

    def setup_decode_graphs(self, batch_sizes: tuple[int, ...], emulate: bool = False) -> None:
        """Capture decode steps as CUDA graphs, block tables as wide as ``max_model_len``
        (``emulate``: static buffers and padding only, run eagerly; for CPU tests). Call again
        after the weights or the KV pool change."""
        self.graphs = None  # NOTE: frees the old graphs' pool before capturing anew
        hidden_fn, logits_fn = self._forward_fns()

        def forward(ids, positions, meta):
            return logits_fn(hidden_fn(ids, positions, meta))

        width, scratch = self.inputs.table_width, self.inputs.scratch_block
        graphs = DecodeGraphs(
            forward, self.device, batch_sizes, width, self.block_size, scratch, emulate
        )
        graphs.capture(getattr(self.stream, "stream", None))
        self.graphs = graphs

    scratch_block = property(lambda self: self.inputs.scratch_block)
    """KV block past the managed pool, written only by graph padding rows."""

    # -- per-request state ---------------------------------------------------------------------
    def _park(self, req_id: str, finished: bool) -> None:
        """A request left the running set: free its slot once no in-flight step uses it."""
        if finished:
            self._finished.add(req_id)
        self.inputs.forget_table(req_id)  # NOTE: a preempted request comes back with a new table
        if self.slots.park(req_id):
            self._released(req_id)

    def _released(self, req_id: str) -> None:
        if req_id in self._finished:  # NOTE: a preempted request keeps its generator
            self._finished.discard(req_id)
            self.sampling_state.forget(req_id)

    def record_tokens(self, events: list[TokenEvent]) -> None:
        """Committed tokens, appended to the penalty histories before the next sample."""
        self.sampling_state.record(events)

    def _track(self, s: ScheduledRequest) -> None:
        self.slots.use(s.req_id)
        self.sampling_state.track(s)

    # -- step ----------------------------------------------------------------------------------
    def prepare_step(self, sched: SchedulerOutput) -> StepHandle:
        """Host half of a launch: build the step's inputs and take its request slots."""
        for req_id in sched.finished_req_ids:
            self._park(req_id, finished=True)
        for req_id in sched.preempted_req_ids:
            self._park(req_id, finished=False)
        buf = self._step_count % 2
        previous = self._handles[buf]
        assert previous is None or previous.collected, "ping-pong slot reused while in flight"
        self._step_count += 1
        handle = StepHandle(sched=sched, buffer=buf)
        self._handles[buf] = handle
        if sched.is_empty:
            return handle
        for s in sched.scheduled:
            self._track(s)
        handle.inputs = self.inputs.build(sched.scheduled, buf, self.slots, self.graphs)
        return handle

    def submit_forward(self, handle: StepHandle) -> None:
        """Enqueue the forward; returns at once. Rows whose input token is still on the device
        read it from their request slot (no host round trip)."""
        step = handle.inputs
        if step is None:
            return
        rows = zip(step.last_index, step.rows, strict=True)
        fed = [(i, self.slots[s.req_id]) for i, s in rows if s.device_fed]
        staging = self.inputs.staging[handle.buffer]
        fed_index = staging.put("fed_index", [i for i, _ in fed])
        fed_slots = staging.put("fed_slots", [slot for _, slot in fed])
        up = self._upload
        hidden_fn, logits_fn = self._forward_fns()
        self.served["graph" if step.graph_batch else "compiled" if self.compiled else "eager"] += 1

        def patch(input_ids: torch.Tensor) -> None:
            if fed:
                input_ids[up(fed_index)] = self.token_buffer[up(fed_slots)]

        def forward() -> None:
            prepare_states(self.state_caches, step.state_moves, self._upload)
            if step.graph_batch:
                logits = self.graphs.run(
                    step.graph_batch, step.input_ids, step.positions, step.meta, patch
                )
                handle.logits = logits[up(step.sample_index)]  # a copy: outlives the replay
                return
            input_ids = up(step.input_ids)
            patch(input_ids)
            with step_lora(step.lora, up):
                hidden = hidden_fn(input_ids, up(step.positions), step.meta.to(up))
            keep_states(self.state_caches, step.state_moves, up)
            if step.sample_rows:
                handle.logits = logits_fn(hidden[up(step.sample_index)])
            if step.prompt_rows:
                k = max(top for _, _, top in step.prompt_rows)
                index, targets = up(step.prompt_index), up(step.prompt_targets)
                lps = prompt_logprobs(hidden, logits_fn, index, targets, k)
                handle.prompt_result = lps.to_host()

        self.stream.submit(forward, tokens=len(step.positions))

    def launch_sample(self, handle: StepHandle, bitmask: torch.Tensor | None = None) -> None:
        """Enqueue sampling with host state as committed now (penalty histories, grammar
        masks); the sampled ids go to the request slots and to host memory, then an event."""
        step = handle.inputs
        if step is None or not step.sample_rows:
            handle.event = self.stream.record()
            return
        rows = [self.sampling_state.row(s) for s in step.sample_rows]
        slots = self.inputs.staging[handle.buffer].put(
            "sample_slots", [self.slots[s.req_id] for s in step.sample_rows]
        )
        masked = [i for i, s in enumerate(step.sample_rows) if s.params.structured_outputs]
        if bitmask is not None and self.device.type == "cuda":
            bitmask = bitmask.pin_memory()  # NOTE: so the upload below does not block the host

        def sample() -> None:
            logits = handle.logits
            if bitmask is not None:  # uploaded in the stream: ordered before its use
                from warmboot.device.grammar_bitmask import apply_bitmask

                apply_bitmask(logits, self._upload(bitmask), masked)
            out = self.sampler(logits, rows)
            self.token_buffer[self._upload(slots)] = out.token_ids
            handle.result = out.to_host()

        self.stream.submit(sample)
        handle.event = self.stream.record()

    def collect(self, handle: StepHandle) -> RunnerOutput:
        """Wait for the step and return its sampled tokens; the step's slots are released."""
        handle.event.wait()
        handle.collected = True
        for s in handle.inputs.rows if handle.inputs else ():
            if self.slots.unuse(s.req_id):
                self._released(s.req_id)
        out = RunnerOutput([], [])
        if handle.result is not None:
            out = handle.result.runner_output(handle.inputs.sample_rows)
        if handle.prompt_result is not None:
            out.prompt_logprobs = handle.prompt_result.split(handle.inputs.prompt_rows)
        return out

    def _upload(self, t: torch.Tensor) -> torch.Tensor:
        return upload(t, self.device)

    def forward_all(self, scheduled: list[ScheduledRequest]) -> torch.Tensor:
        """(tokens, vocab) logits of every token of ``scheduled``, outside the loops, on the
        host thread (tests and probes; idle runner only)."""
        assert not self.in_flight(), "forward_all needs an idle runner"
        step = self.inputs.build(scheduled, 0, self.slots, None)
        for s in scheduled:
            self.slots.park(s.req_id)
        hidden_fn, logits_fn = self._forward_fns()
        with torch.inference_mode(), torch_threads(self.cpu_threads):
            up = self._upload
            prepare_states(self.state_caches, step.state_moves, up)
            ids, positions, meta = up(step.input_ids), up(step.positions), step.meta.to(up)
            with step_lora(step.lora, up):
                hidden = hidden_fn(ids, positions, meta)
            keep_states(self.state_caches, step.state_moves, up)
            return logits_fn(hidden)

    # -- checks --------------------------------------------------------------------------------
    def in_flight(self) -> list[StepHandle]:
        """Launched steps not yet collected, oldest first."""
        live = [h for h in self._handles if h is not None and not h.collected]
        return sorted(live, key=lambda h: h.buffer != (self._step_count % 2))

    def check_invariants(self) -> None:
        """Slots, staging sets and per-request state agree with the steps in flight: raise
        ``AssertionError`` naming the first broken rule."""
        in_flight = self.in_flight()
        assert len(in_flight) <= 2, "more than two steps in flight"
        assert len({h.buffer for h in in_flight}) == len(in_flight), "two steps share a set"
        rows: Counter[str] = Counter()
        for h in in_flight:
            if h.inputs is None:
                continue
            staging = self.inputs.staging[h.buffer]
            assert staging.owns(h.inputs.input_ids), "a step's ids live outside its set"
            rows.update(s.req_id for s in h.inputs.rows)
        self.slots.check_invariants(rows)
        assert self._finished <= self.slots.live, "a finished request's state outlived its slot"

    def request_state(self) -> set[str]:
        """Requests the runner holds anything for (a slot, a generator, penalty histories)."""
        return self.slots.live | self.sampling_state.req_ids

    def penalised(self) -> set[str]:
        """Requests the runner keeps penalty histories for."""
        return set(self.sampling_state.histories)

    def leaving(self) -> set[str]:
        """Requests whose state goes once no in-flight step uses them (parked or finished)."""
        return self.slots.parked | self._finished
