"""The model runner owns every device tensor (weights, KV cache, per-request token slots and
generators) and turns a ``SchedulerOutput`` into a ``RunnerOutput`` in three calls that the
loops order: ``prepare_step`` + ``submit_forward``, ``launch_sample``, ``collect``."""

from __future__ import annotations

import mmap
import weakref
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from warmboot.config import ModelConfig
from warmboot.engine.device import Event, make_stream
from warmboot.engine.graphs import DecodeGraphs
from warmboot.engine.sampler import (
    Sampler,
    SamplerOutput,
    SamplingRow,
    TokenHistory,
    make_generator,
)
from warmboot.engine.scheduler import RunnerOutput, ScheduledRequest, SchedulerOutput, TokenLogprobs
from warmboot.kernels.backend import AttentionBackend, AttentionMetadata, PrefillSeq
from warmboot.models.decoder import DecoderModel
from warmboot.models.loader import assemble_model, load_model


@dataclass
class StepInputs:
    """Host-built tensors of one step (rows ordered decodes first)."""

    rows: list[ScheduledRequest]
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: list[ScheduledRequest]
    sample_index: torch.Tensor
    """(num_sampling_rows,) index of each sampling row's last token in the batch."""
    last_index: list[int]
    """Per row: index of its last token in the batch."""
    graph_batch: int | None = None
    """Decode-only step run as a CUDA graph: rows padded to this captured batch size."""


class Staging:
    """One ping-pong working set: preallocated host tensors (pinned on CUDA) that a step's
    inputs are written into and uploaded from. The runner reuses a set only after the step
    that last used it has been collected, so its uploads have completed."""

    ROWS = ("seq_lens", "sample_index", "fed_index", "fed_slots", "sample_slots")
    TOKENS = ("ids", "positions", "slots")

    def __init__(self, max_tokens: int, max_rows: int, width: int, pin: bool):
        def buf(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int64, pin_memory=pin)

        self._bufs = {name: buf(max_tokens) for name in self.TOKENS}
        self._bufs |= {name: buf(max_rows) for name in self.ROWS}
        self._tables = buf(max_rows * width)
        self._pin = pin

    def put(self, name: str, values: list[int]) -> torch.Tensor:
        """``values`` as a view of the named buffer (a fresh tensor if they do not fit)."""
        buf = self._bufs[name]
        if len(values) > buf.shape[0]:  # NOTE: not expected: the scheduler bounds a step
            return _fresh(values, self._pin)
        view = buf[: len(values)]
        view.numpy()[:] = values
        return view

    def tables(self, source: np.ndarray, rows: list[int], width: int) -> torch.Tensor:
        """(len(rows), width) view holding ``source[rows, :width]``, copied in C."""
        n = len(rows)
        if n * width > self._tables.shape[0]:
            return _fresh(source[rows, :width], self._pin)
        view = self._tables[: n * width].view(n, width)
        np.take(source[:, :width], rows, axis=0, out=view.numpy())
        return view


def _fresh(values, pin: bool) -> torch.Tensor:
    t = torch.from_numpy(np.array(values, dtype=np.int64))
    return t.pin_memory() if pin else t


@dataclass
class StepHandle:
    """One launched step: a future for its sampled tokens."""

    sched: SchedulerOutput
    buffer: int
    """Ping-pong working set (step number mod 2)."""
    inputs: StepInputs | None = None
    logits: torch.Tensor | None = None
    result: SamplerOutput | None = None
    """Host copies of the sampler's output, valid once ``event`` has completed."""
    event: Event | None = None
    collected: bool = False
    held_seqs: list[str] = field(default_factory=list)
    """Sequences whose KV blocks this step references; held until it retires."""


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
        self.model_cfg = model_cfg
        self.dtype = dtype
        self.device = device
        self.attention = attention
        self.block_size = block_size
        self.model: DecoderModel | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.sampler = Sampler()
        self.stream = make_stream(device, cpu_threads)
        weakref.finalize(self, self.stream.close)
        self._generators: dict[str, torch.Generator] = {}
        self._histories: dict[str, tuple[TokenHistory, TokenHistory]] = {}
        """Per penalised request: its prompt and output as host tensors."""
        self._buffers: list[StepHandle | None] = [None, None]
        self._step_count = 0
        self.token_buffer = torch.zeros(num_request_slots, dtype=torch.int64, device=device)
        """Per request slot: the last sampled token (written by sample, read by forward)."""
        self._slots: dict[str, int] = {}
        self._free_slots = list(range(num_request_slots - 1, -1, -1))
        self._slot_users: Counter[str] = Counter()
        self._parked: set[str] = set()
        self._finished: set[str] = set()
        width = -(-max_model_len // block_size)
        self._tables = np.zeros((num_request_slots + 1, width), dtype=np.int64)
        """Host block tables per request slot, appended as tables grow (decode rows copy
        theirs in C, not per block in Python); the last row is the graph padding row."""
        self._table_len: dict[str, int] = {}
        """Per request: entries of its table already in ``_tables``."""
        pin = device.type == "cuda"
        tokens = max(max_num_batched_tokens, max_num_seqs)
        self._staging = [Staging(tokens, max_num_seqs, width, pin) for _ in range(2)]
        self.scratch_block = 0
        """KV block past the managed pool, written only by graph padding rows."""
        self.graphs: DecodeGraphs | None = None

    # -- start-up phases -----------------------------------------------------------------------
    def load_model(self, model_dir: str | Path) -> None:
        self.model = load_model(model_dir, self.model_cfg, self.dtype, self.device)
        self._settle()

    def install_weights(self, tensors: dict[str, torch.Tensor], source: str) -> None:
        """Use weights that are already transformed (a snapshot's ``named_parameters``)."""
        self.model = assemble_model(
            self.model_cfg, tensors.items(), self.dtype, self.device, source
        )
        self._settle()

    def kv_bytes_per_block(self) -> int:
        cfg = self.model_cfg
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * cfg.num_layers * self.block_size * cfg.kv_size * elem

    def pretune_attention(self, max_q: int, max_k: int) -> int:
        """Tune the attention backend's prefill for every shape bucket (start-up, idle)."""
        cfg = self.model_cfg
        k_cache, v_cache = self.kv_caches[0]
        windows = set(cfg.sliding_windows)
        scale = cfg.head_dim**-0.5
        return self.attention.pretune(k_cache, v_cache, cfg.num_heads, scale, windows, max_q, max_k)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """``num_blocks`` for the block manager plus the scratch block."""
        cfg = self.model_cfg
        self.scratch_block = num_blocks
        # NOTE: a table row's columns past its length are read (masked) by the torch backend:
        # ids left from an earlier, larger pool would index past this one
        self._tables.fill(0)
        self._table_len.clear()
        self._tables[-1] = num_blocks
        num_blocks += 1
        shape = (cfg.num_layers, 2, num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        if self.device.type == "cpu":
            # NOTE: a fresh anonymous mapping reads as zeros without touching its pages, so the
            # pool costs nothing until blocks are written (and nothing in a process image).
            nbytes = num_blocks * self.kv_bytes_per_block()
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
            self._kv_buffer = mmap.mmap(-1, nbytes, flags=flags)
            cache = torch.frombuffer(self._kv_buffer, dtype=self.dtype).view(shape)
        else:
            cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.kv_caches = [(cache[i, 0], cache[i, 1]) for i in range(cfg.num_layers)]
        self._settle()

    def _settle(self) -> None:
        """Wait for start-up work queued on the default stream (weight copies, zero fills):
        the loops run on their own stream, which does not wait for it."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def setup_decode_graphs(self, batch_sizes: tuple[int, ...], emulate: bool = False) -> None:
        """Capture decode steps as CUDA graphs, block tables as wide as ``max_model_len``
        (``emulate``: static buffers and padding only, run eagerly; for CPU tests). Call again
        after the weights or the KV pool change."""
        self.graphs = None  # NOTE: frees the old graphs' pool before capturing anew
        model, attention = self.model, self.attention

        def forward(ids, positions, meta):
            hidden = model(ids, positions, self.kv_caches, meta, attention)
            return model.compute_logits(hidden)

        width = self._tables.shape[1]
        graphs = DecodeGraphs(
            forward, self.device, batch_sizes, width, self.block_size, self.scratch_block, emulate
        )
        graphs.capture(getattr(self.stream, "stream", None))
        self.graphs = graphs

    # -- requests' device slots -------------------------------------------------------------
    def _slot_of(self, req_id: str) -> int:
        slot = self._slots.get(req_id)
        if slot is None:
            if not self._free_slots:
                raise RuntimeError("no free request slot: more live requests than slots")
            slot = self._slots[req_id] = self._free_slots.pop()
        return slot

    def _park(self, req_id: str, finished: bool) -> None:
        """A request left the running set: free its slot once no in-flight step uses it."""
        if finished:
            self._finished.add(req_id)
        self._parked.add(req_id)
        self._table_len.pop(req_id, None)  # NOTE: a preempted request comes back with a new table
        self._release_if_idle(req_id)

    def _release_if_idle(self, req_id: str) -> None:
        if req_id in self._parked and not self._slot_users[req_id]:
            self._parked.discard(req_id)
            self._slot_users.pop(req_id, None)
            slot = self._slots.pop(req_id, None)
            if slot is not None:
                self._free_slots.append(slot)
            if req_id in self._finished:
                self._finished.discard(req_id)
                self._generators.pop(req_id, None)
                self._histories.pop(req_id, None)

    # -- step ----------------------------------------------------------------------------------
    def prepare_step(self, sched: SchedulerOutput) -> StepHandle:
        """Host half of a launch: build the step's inputs and take its request slots."""
        for req_id in sched.finished_req_ids:
            self._park(req_id, finished=True)
        for req_id in sched.preempted_req_ids:
            self._park(req_id, finished=False)  # NOTE: keeps its generator: the stream goes on
        buf = self._step_count % 2
        previous = self._buffers[buf]
        assert previous is None or previous.collected, "ping-pong slot reused while in flight"
        self._step_count += 1
        handle = StepHandle(sched=sched, buffer=buf)
        self._buffers[buf] = handle
        if sched.is_empty:
            return handle
        for s in sched.scheduled:
            self._parked.discard(s.req_id)
            self._slot_of(s.req_id)
            self._slot_users[s.req_id] += 1
        handle.inputs = self.prepare(sched.scheduled, buf)
        return handle

    def submit_forward(self, handle: StepHandle) -> None:
        """Enqueue the forward; returns at once. Rows whose input token is still on the device
        read it from their request slot (no host round trip)."""
        step = handle.inputs
        if step is None:
            return
        rows = zip(step.last_index, step.rows, strict=True)
        fed = [(i, self._slots[s.req_id]) for i, s in rows if s.device_fed]
        staging = self._staging[handle.buffer]
        fed_index = staging.put("fed_index", [i for i, _ in fed])
        fed_slots = staging.put("fed_slots", [slot for _, slot in fed])

        def patch(input_ids: torch.Tensor) -> None:
            if fed:
                up = self._upload
                input_ids[up(fed_index)] = self.token_buffer[up(fed_slots)]

        def forward() -> None:
            up = self._upload
            if step.graph_batch:
                logits = self.graphs.run(
                    step.graph_batch, step.input_ids, step.positions, step.meta, patch
                )
                handle.logits = logits[up(step.sample_index)]  # a copy: outlives the replay
                return
            input_ids = up(step.input_ids)
            patch(input_ids)
            meta = step.meta.to(up)
            hidden = self.model(input_ids, up(step.positions), self.kv_caches, meta, self.attention)
            if step.sample_rows:
                handle.logits = self.model.compute_logits(hidden[up(step.sample_index)])

        self.stream.submit(forward)

    def launch_sample(self, handle: StepHandle, bitmask: torch.Tensor | None = None) -> None:
        """Enqueue sampling with host state as committed now (penalty histories, grammar
        masks); the sampled ids go to the request slots and to host memory, then an event."""
        step = handle.inputs
        if step is None or not step.sample_rows:
            handle.event = self.stream.record()
            return
        rows = [self._sampling_row(s) for s in step.sample_rows]
        slots = self._staging[handle.buffer].put(
            "sample_slots", [self._slots[s.req_id] for s in step.sample_rows]
        )
        masked = [i for i, s in enumerate(step.sample_rows) if s.params.structured_outputs]
        if bitmask is not None and self.device.type == "cuda":
            bitmask = bitmask.pin_memory()  # NOTE: so the upload below does not block the host

        def sample() -> None:
            logits = handle.logits
            if bitmask is not None:  # uploaded in the stream: ordered before its use
                from warmboot.engine.grammar import apply_bitmask

                apply_bitmask(logits, self._upload(bitmask), masked)
            out = self.sampler(logits, rows)
            self.token_buffer[self._upload(slots)] = out.token_ids
            handle.result = _to_host(out)

        self.stream.submit(sample)
        handle.event = self.stream.record()

    def collect(self, handle: StepHandle) -> RunnerOutput:
        """Wait for the step and return its sampled tokens; the step's slots are released."""
        handle.event.wait()
        handle.collected = True
        for s in handle.inputs.rows if handle.inputs else ():
            self._slot_users[s.req_id] -= 1
            self._release_if_idle(s.req_id)
        if handle.result is None:
            return RunnerOutput([], [])
        rows = handle.inputs.sample_rows
        return self._to_output(rows, handle.result)

    def _host(self, values: list) -> torch.Tensor:
        """A fresh int64 host tensor, pinned when the device is a GPU (so uploads are async)."""
        return _fresh(values, self.device.type == "cuda")

    def _upload(self, t: torch.Tensor) -> torch.Tensor:
        """Host -> device inside the stream: non-blocking from pinned memory; no-op on CPU."""
        return t.to(self.device, non_blocking=True)

    def prepare(self, scheduled: list[ScheduledRequest], buffer: int = 0) -> StepInputs:
        """The step's inputs, written into the ping-pong working set ``buffer``."""
        bs = self.block_size
        staging = self._staging[buffer]
        rows = sorted(scheduled, key=lambda s: s.num_tokens != 1)  # decodes first, stable
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_index: list[int] = []
        for s in rows:
            table = s.block_table
            for pos in range(s.start_pos, s.start_pos + s.num_tokens):
                slots.append(table[pos // bs] * bs + pos % bs)
            positions.extend(range(s.start_pos, s.start_pos + s.num_tokens))
            ids.extend(s.token_ids)
            last_index.append(len(ids) - 1)
        num_decodes = sum(1 for s in rows if s.num_tokens == 1)
        width = max((len(s.block_table) for s in rows[:num_decodes]), default=0)
        graph_batch = self._graph_batch(len(rows), num_decodes, width)
        pad = graph_batch - num_decodes if graph_batch else 0
        if pad:  # padding rows of a graph step: token 0 at the scratch slot, one key
            ids += [0] * pad
            positions += [0] * pad
            slots += [self.scratch_block * bs] * pad
        host = self._host
        meta = AttentionMetadata(
            slot_mapping=staging.put("slots", slots),
            num_decode_tokens=num_decodes + pad,
            decode_block_tables=None,
            decode_seq_lens=None,
            prefills=[],
            block_size=bs,
        )
        if num_decodes:
            decodes = rows[:num_decodes]
            meta.decode_block_tables = self._decode_tables(staging, decodes, pad, width)
            lens = [s.start_pos + 1 for s in decodes] + [1] * pad
            meta.decode_seq_lens = staging.put("seq_lens", lens)
        start = num_decodes
        for s in rows[num_decodes:]:
            ctx = s.start_pos + s.num_tokens
            table = host(s.block_table[: -(-ctx // bs)])
            meta.prefills.append(PrefillSeq(start, s.num_tokens, ctx, table))
            start += s.num_tokens
        sampling = [i for i, s in enumerate(rows) if s.sample]
        return StepInputs(
            rows=rows,
            input_ids=staging.put("ids", ids),
            positions=staging.put("positions", positions),
            meta=meta,
            sample_rows=[rows[i] for i in sampling],
            sample_index=staging.put("sample_index", [last_index[i] for i in sampling]),
            last_index=last_index,
            graph_batch=graph_batch,
        )

    def _decode_tables(
        self, staging: Staging, decodes: list[ScheduledRequest], pad: int, width: int
    ) -> torch.Tensor:
        """(rows + pad, ``width``: the widest table) host tensor from the per-slot tables,
        after appending each row's new blocks; padding rows point at the scratch block."""
        tables = self._tables
        slots = []
        for s in decodes:
            slot = self._slot_of(s.req_id)
            known = self._table_len.get(s.req_id, 0)
            if len(s.block_table) > known:
                tables[slot, known : len(s.block_table)] = s.block_table[known:]
                self._table_len[s.req_id] = len(s.block_table)
            slots.append(slot)
        return staging.tables(tables, slots + [len(tables) - 1] * pad, width)

    def _graph_batch(self, num_rows: int, num_decodes: int, width: int) -> int | None:
        """The graph bucket of a decode-only step whose widest table is ``width``, or None
        (eager)."""
        if self.graphs is None or not num_rows or num_decodes != num_rows:
            return None
        if width > self.graphs.width:
            return None
        return self.graphs.bucket(num_decodes)

    def _sampling_row(self, s: ScheduledRequest) -> SamplingRow:
        gen = None
        if s.params.seed is not None:
            gen = self._generators.get(s.req_id)
            if gen is None:
                gen = self._generators[s.req_id] = make_generator(s.params.seed, self.device)
        prompt, output = s.prompt_token_ids, s.output_token_ids
        if s.params.uses_penalties:  # NOTE: tensors, so the sampler converts no list per step
            histories = self._histories.get(s.req_id)
            if histories is None:
                histories = self._histories[s.req_id] = (TokenHistory(), TokenHistory())
            prompt, output = histories[0].sync(prompt), histories[1].sync(output)
        return SamplingRow(
            params=s.params,
            prompt_token_ids=prompt,
            output_token_ids=output,
            generator=gen,
            suppress_token_ids=s.suppress_token_ids,
        )

    @staticmethod
    def _to_output(rows: list[ScheduledRequest], out: SamplerOutput) -> RunnerOutput:
        """``out`` holds host tensors."""
        token_ids = out.token_ids.tolist()
        logprobs = None
        if out.sampled_logprobs is not None:
            sampled = out.sampled_logprobs.tolist()
            top_ids, top_lps = out.top_token_ids.tolist(), out.top_logprobs.tolist()
            logprobs = []
            for i, s in enumerate(rows):
                k = s.params.logprobs
                if k is None:
                    logprobs.append(None)
                    continue
                top = list(zip(top_ids[i][:k], top_lps[i][:k], strict=True))
                logprobs.append(TokenLogprobs(sampled[i], top))
        return RunnerOutput([s.req_id for s in rows], token_ids, logprobs)


def _to_host(out: SamplerOutput) -> SamplerOutput:
    """Copy the sampler's tensors to host memory (non-blocking on CUDA; ordered by the event
    recorded after them)."""

    def host(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None or t.device.type == "cpu":
            return t
        return t.to("cpu", non_blocking=True)

    return SamplerOutput(
        host(out.token_ids),
        host(out.sampled_logprobs),
        host(out.top_logprobs),
        host(out.top_token_ids),
    )
