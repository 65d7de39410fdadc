"""The engine: explicit, timed start-up phases, then ``step()`` = schedule -> run -> update."""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from warmboot.config import EngineConfig, ModelConfig, ModelFilesError, SchedulerConfig
from warmboot.engine.errors import InvalidRequestError
from warmboot.engine.graphs import default_batch_sizes
from warmboot.engine.kv_cache import BlockManager
from warmboot.engine.loop import BubbleMeter, PipelinedLoop, SyncLoop
from warmboot.engine.output_processor import CompletionState, OutputProcessor, RequestGroup
from warmboot.engine.request import FinishReason, Request
from warmboot.engine.runner import ModelRunner, StepHandle
from warmboot.engine.scheduler import Scheduler, SchedulerOutput
from warmboot.engine.structured import GrammarRequests
from warmboot.kernels.backend import AttentionBackend
from warmboot.kernels.torch_attention import TorchAttentionBackend
from warmboot.outputs import RequestOutput
from warmboot.sampling_params import SamplingParams
from warmboot.tokenizer import Tokenizer

log = logging.getLogger("warmboot")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CPU_DEFAULT_KV_BYTES = 512 << 20
GPU_MEMORY_UTILIZATION = 0.9

Prompt = str | list[int] | dict


@dataclass(frozen=True)
class RuntimeFacts:
    """Values discovered at start-up (never written back into the configs)."""

    device: str
    dtype: str
    num_kv_blocks: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    attention_backend: str


@dataclass(frozen=True)
class StartInfo:
    """How the engine started: ``path`` is "cold" or "restored_image" (a tier-A snapshot)."""

    path: str
    reason: str
    """Why that path: the matching snapshot, or why none was used."""
    ready_s: float
    """Seconds from the start of ``LLMEngine.__init__`` to ready (publishing included)."""
    phase_times: dict[str, float] = field(default_factory=dict)


class LLMEngine:
    def __init__(self, config: EngineConfig, max_model_len: int | None = None):
        t_start = time.perf_counter()
        self.config = config
        self.startup_times: dict[str, float] = {}
        self._ids = itertools.count()
        self._submissions = itertools.count()
        model_dir = Path(config.model)
        with self._phase("config"):
            if not model_dir.is_dir():
                raise ModelFilesError(f"model directory {model_dir} does not exist")
            self.model_config = ModelConfig.from_dir(model_dir)
            device = _resolve_device(config.device)
            dtype = _resolve_dtype(config.dtype, self.model_config, device)
            self.sched_config = self._resolve_scheduler(max_model_len)
        with self._phase("tokenizer"):
            self.tokenizer = Tokenizer.from_dir(model_dir)
            eos = _eos_ids(model_dir, self.model_config, self.tokenizer)
        torch.manual_seed(config.seed)
        attention = _attention_backend(config.attention_backend, device)
        use_graphs = _resolve_cuda_graphs(config.cuda_graphs, device)
        self.pipelined = _resolve_pipelined(config.pipelined, device)
        threads = _cpu_threads(config, device, self.pipelined)
        self.runner = ModelRunner(
            self.model_config,
            dtype,
            device,
            attention,
            config.cache.block_size,
            num_request_slots=2 * self.sched_config.max_num_seqs + 2,
            max_model_len=self.sched_config.max_model_len,
            max_num_seqs=self.sched_config.max_num_seqs,
            max_num_batched_tokens=self.sched_config.max_num_batched_tokens,
            cpu_threads=threads,
        )
        self.grammars: GrammarRequests | None = None
        self.snapshot = self._open_snapshot(model_dir, device, dtype, attention.name)
        restored = self._restore_weights()
        if not restored:
            with self._phase("load_weights"):
                self.runner.load_model(model_dir)
        with self._phase("allocate_kv"):
            num_blocks = self._num_kv_blocks(device)
            self.runner.allocate_kv_cache(num_blocks)
        self.facts = RuntimeFacts(
            device=str(device),
            dtype=str(dtype).removeprefix("torch."),
            num_kv_blocks=num_blocks,
            max_model_len=self.sched_config.max_model_len,
            eos_token_ids=eos,
            attention_backend=attention.name,
        )
        self._new_scheduler()
        with self._phase("warmup"):
            canary = self._warmup()
        if restored and not self.snapshot.canary_matches(canary):
            restored = False
            log.warning("snapshot canary failed (%s); booting cold", self.snapshot.reason)
            with self._phase("load_weights"):
                self.runner.load_model(model_dir)
            with self._phase("warmup"):
                canary = self._warmup()
        publishing = bool(self.snapshot and not restored and config.snapshot_publish)
        if wants_pretune(config.pretune_attention, device, attention.name, publishing):
            with self._phase("autotune"):
                sched = self.sched_config
                shapes = self.runner.pretune_attention(
                    sched.max_num_batched_tokens, sched.max_model_len
                )
            log.info("attention tuned for %d prefill shapes", shapes)
        self.graphs_note = "off"
        """CUDA graphs: on, off, emulated (CPU tests), or off with the capture's error."""
        if use_graphs:
            with self._phase("cuda_graphs"):
                self._capture_graphs(required=bool(config.cuda_graphs))
        reason = self.snapshot.reason if self.snapshot else "no snapshot store configured"
        if publishing:
            with self._phase("snapshot_publish"):
                facts = asdict(self.facts) | {"canary": canary}
                self.snapshot.publish(self.runner.model, facts | {"cold_boot": self.startup_times})
        self.start_info = StartInfo(
            path="restored_image" if restored else "cold",
            reason=reason,
            ready_s=time.perf_counter() - t_start,
            phase_times=dict(self.startup_times),
        )
        log.info(
            "engine ready in %.2fs via %s (%s): %s",
            self.start_info.ready_s,
            self.start_info.path,
            reason,
            ", ".join(f"{k} {v:.2f}s" for k, v in self.startup_times.items()),
        )

    # -- start-up helpers ----------------------------------------------------------------------
    @contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        self.startup_times[name] = time.perf_counter() - t0
        log.info("start-up phase %-12s %.3fs", name, self.startup_times[name])

    def _open_snapshot(self, model_dir: Path, device, dtype, attention: str):
        if self.config.snapshot_store is None:
            return None
        from warmboot.snapshot.boot import SnapshotBoot

        settings = {
            "dtype": str(dtype).removeprefix("torch."),
            "device_type": device.type,
            "block_size": self.config.cache.block_size,
            "max_model_len": self.sched_config.max_model_len,
            "max_num_seqs": self.sched_config.max_num_seqs,
            "max_num_batched_tokens": self.sched_config.max_num_batched_tokens,
            "attention_backend": attention,
        }
        with self._phase("snapshot_key"):
            return SnapshotBoot(self.config.snapshot_store, model_dir, settings, device)

    def _restore_weights(self) -> bool:
        """Restore the runner's weights from a matching snapshot; False (reason logged) if none."""
        if self.snapshot is None:
            return False
        with self._phase("snapshot_lookup"):
            manifest = self.snapshot.lookup()
        if manifest is not None:
            with self._phase("restore_weights"):
                tensors = self.snapshot.restore(manifest, self.runner.dtype)
                if tensors is not None:
                    try:
                        self.runner.install_weights(tensors, f"snapshot {manifest.key}")
                    except ValueError as e:
                        self.snapshot.reason = f"snapshot {manifest.key} does not fit: {e}"
                        tensors = None
            if tensors is not None:
                return True
        log.info("snapshot not used, booting cold: %s", self.snapshot.reason)
        return False

    def _resolve_scheduler(self, max_model_len: int | None) -> SchedulerConfig:
        limit = self.model_config.max_position_embeddings
        cfg = self.config.scheduler
        length = max_model_len or min(cfg.max_model_len, limit)
        if length > limit:
            raise ValueError(
                f"max_model_len={length} exceeds the model's max_position_embeddings={limit}"
            )
        return replace(cfg, max_model_len=length)

    def _num_kv_blocks(self, device: torch.device) -> int:
        cache, per_block = self.config.cache, self.runner.kv_bytes_per_block()
        if cache.num_blocks is not None:
            blocks = cache.num_blocks
        elif cache.kv_cache_memory_bytes is not None:
            blocks = cache.kv_cache_memory_bytes // per_block
        elif device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            blocks = int(free - (1 - GPU_MEMORY_UTILIZATION) * total) // per_block
        else:
            full = self.sched_config.max_num_seqs * self.sched_config.max_model_len
            blocks = min(-(-full // cache.block_size), CPU_DEFAULT_KV_BYTES // per_block)
        capacity = blocks * cache.block_size
        if capacity < self.sched_config.max_model_len:
            raise ValueError(
                f"the KV cache holds {capacity} tokens ({blocks} blocks), fewer than "
                f"max_model_len={self.sched_config.max_model_len}; raise the KV memory budget "
                "or lower max_model_len"
            )
        return blocks

    def enable_decode_graphs(
        self, batch_sizes: tuple[int, ...] | None = None, emulate: bool = False
    ) -> None:
        """Capture decode steps as CUDA graphs for ``batch_sizes`` (default: 1, 2, 4, 8,
        multiples of 16 up to ``max_num_seqs``). ``emulate``: run the graph path eagerly (CPU
        tests: static buffers and padding without a capture). Idle engine only."""
        if self.has_unfinished_requests():
            raise RuntimeError("enable_decode_graphs needs an idle engine")
        sizes = batch_sizes or default_batch_sizes(self.sched_config.max_num_seqs)
        self.runner.setup_decode_graphs(sizes, emulate)
        self.graphs_note = "emulated" if emulate else "on"

    def _capture_graphs(self, required: bool) -> None:
        """Capture at start-up. A capture that fails runs decode eagerly (with the reason in
        the log and ``stats()``) unless graphs were asked for explicitly."""
        try:
            self.enable_decode_graphs()
        except Exception as e:
            if required:
                raise
            self.runner.graphs = None
            self.graphs_note = f"off: capture failed: {type(e).__name__}: {e}"
            log.warning("CUDA graph capture failed, decode runs eagerly: %s", e)

    def _recapture_graphs(self) -> None:
        """Captured graphs hold the old weights' and KV pool's addresses: capture anew."""
        graphs = self.runner.graphs
        if graphs is not None:
            self.enable_decode_graphs(graphs.batch_sizes, graphs.emulate)

    def _new_scheduler(self) -> None:
        cache = self.config.cache
        self.block_manager = BlockManager(
            self.facts.num_kv_blocks, cache.block_size, cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(self.sched_config, self.block_manager)
        self.outputs = OutputProcessor(self.tokenizer)
        self.meter = BubbleMeter()
        self.loop = PipelinedLoop(self) if self.pipelined else SyncLoop(self)

    def _warmup(self) -> list[tuple[int, float]]:
        """Run one short real request through every part, then forget it; returns its greedy
        tokens with their logprobs (a snapshot's canary)."""
        # NOTE: not token 0, often a padding token whose zero embedding would make the canary blind
        canary = self._greedy_probe([1, 2, 3], max_tokens=2, logprobs=1)
        self.block_manager.check_invariants()
        return canary

    def _greedy_probe(self, prompt: list[int], max_tokens: int, logprobs: int):
        """Run one greedy request alone (idle engine) and forget it: [(token, logprob)]."""
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=True,
            logprobs=logprobs,
            output_kind="final",
        )
        self.add_request("probe", {"prompt_token_ids": prompt}, params)
        out = None
        while self.has_unfinished_requests():
            out = next(iter(self.step()), out)
        self.block_manager.reset_prefix_cache()
        c = out.outputs[0]
        return [(t, lp[t].logprob) for t, lp in zip(c.token_ids, c.logprobs, strict=True)]

    # -- requests ------------------------------------------------------------------------------
    def add_request(
        self, request_id: str | None, prompt: Prompt, params: SamplingParams | None = None
    ) -> str:
        """Validate and queue a request; raise ``InvalidRequestError`` (nothing queued) if bad."""
        params = params or SamplingParams()
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.outputs.groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        text, token_ids = self.validate(prompt, params)
        max_tokens = self._max_tokens(token_ids, params)
        eos = frozenset(self.facts.eos_token_ids)
        children, states = [], []
        # NOTE: internal ids are unique per submission, so a user id reused while a zombie row
        # of its previous request is still in flight never collides with it.
        submission = next(self._submissions)
        for i in range(params.n):
            child_params = params if params.seed is None else replace(params, seed=params.seed + i)
            children.append(
                Request(
                    request_id=f"{request_id}#{i}@{submission}",
                    prompt_token_ids=list(token_ids),
                    params=child_params,
                    max_tokens=max_tokens,
                    eos_token_ids=eos,
                    leader=children[0] if children else None,
                    completion_index=i,
                )
            )
            logprobs = [] if params.logprobs is not None else None
            detok = self.tokenizer.detokenizer(params.skip_special_tokens)
            states.append(CompletionState(i, child_params, detok, logprobs=logprobs))
        self.outputs.add(RequestGroup(request_id, text, list(token_ids), states, children))
        for child in children:
            if params.structured_outputs is not None:
                self.grammars.add(child.request_id, params.structured_outputs)
            self.scheduler.add_request(child)
        return request_id

    def validate(self, prompt: Prompt, params: SamplingParams) -> tuple[str | None, list[int]]:
        """Tokenize and check a request; raise ``InvalidRequestError`` naming the problem."""
        text, token_ids = self._tokenize(prompt)
        self._max_tokens(token_ids, params)
        vocab = self.model_config.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise InvalidRequestError(f"stop_token_ids {bad} are outside the vocabulary ({vocab})")
        bad = [t for t, _ in params.logit_bias or () if t >= vocab]
        if bad:
            raise InvalidRequestError(
                f"logit_bias tokens {bad} are outside the vocabulary ({vocab})"
            )
        if params.structured_outputs is not None:
            self._compile_grammar(params)
        return text, token_ids

    def _grammar_backend(self) -> GrammarRequests:
        if self.grammars is None:
            tokenizer_json = Path(self.config.model) / "tokenizer.json"
            vocab, eos = self.model_config.vocab_size, self.facts.eos_token_ids
            self.grammars = GrammarRequests(tokenizer_json, vocab, eos)
        return self.grammars

    def _compile_grammar(self, params: SamplingParams) -> None:
        try:
            self._grammar_backend().compile(params.structured_outputs)
        except ValueError as e:
            raise InvalidRequestError(f"invalid structured_outputs: {e}") from None

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                return prompt.get("prompt"), self._check_ids(ids)
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty")
            return prompt, self._check_ids(self.tokenizer.encode(prompt))
        if isinstance(prompt, list):
            return None, self._check_ids(prompt)
        raise InvalidRequestError(f"unsupported prompt type {type(prompt).__name__}")

    def _check_ids(self, ids: list[int]) -> list[int]:
        if not ids:
            raise InvalidRequestError("the prompt is empty (no tokens)")
        vocab = self.model_config.vocab_size
        try:  # NOTE: numpy checks a 4k-token prompt in ~0.1 ms; a Python loop took ~3 ms
            arr = np.asarray(ids)
        except (ValueError, TypeError, OverflowError):
            arr = None
        if (
            arr is None
            or arr.ndim != 1
            or arr.dtype.kind not in "iu"
            or not (0 <= arr.min() and arr.max() < vocab)
        ):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})")
        return arr.tolist()

    def _max_tokens(self, token_ids: list[int], params: SamplingParams) -> int:
        limit = self.sched_config.max_model_len
        room = limit - len(token_ids)
        if room < 1:
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens; max_model_len is {limit}, which leaves "
                "no room for output"
            )
        if params.max_tokens is not None and params.max_tokens > room:
            raise InvalidRequestError(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len={limit}"
            )
        return params.max_tokens or room

    def abort_request(self, request_id: str) -> None:
        children = self.outputs.child_ids(request_id)
        self.scheduler.finish_requests(children, FinishReason.ABORT)
        self.outputs.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.outputs.groups) or self.scheduler.has_unfinished() or self.loop.in_flight()

    # -- step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One loop iteration (commits one step); returns the outputs of advanced requests,
        each shaped by its ``output_kind`` ("final" ones only once they end)."""
        return self.take_outputs(self.loop.step())

    def take_outputs(self, touched: set[str]) -> list[RequestOutput]:
        """The outputs due after a step that advanced the groups ``touched``; forgets the
        groups that finished."""
        touched = touched | self.outputs.finished
        outputs = []
        for rid in [r for r in self.outputs.groups if r in touched]:
            group = self.outputs.groups[rid]
            if group.output_kind == "final" and not group.finished:
                continue
            outputs.append(group.output())
            if group.finished:
                self.outputs.pop_finished(rid)
                if self.grammars:
                    self.grammars.drop([c.request_id for c in group.children])
        return outputs

    def launch(self, sched: SchedulerOutput) -> StepHandle:
        """Host half of a launch; the step holds its sequences' blocks until it retires (zombies)."""
        handle = self.runner.prepare_step(sched)
        handle.held_seqs = [s.req_id for s in sched.scheduled]
        self.block_manager.hold_seqs(handle.held_seqs)
        self.meter.launched_rows += len(sched.scheduled)
        return handle

    def launch_sample(self, handle: StepHandle) -> None:
        bitmask = self.grammars.bitmask(handle) if self.grammars else None
        self.runner.launch_sample(handle, bitmask)

    def commit(self, handle: StepHandle) -> set[str]:
        """Wait for a step, apply its tokens, finalize stopped requests, retire the step."""
        result = self.runner.collect(handle)
        touched: set[str] = set()
        if handle.inputs is not None:
            events = self.scheduler.update(handle.sched, result)
            ended = self.grammars.accept(events) if self.grammars else []
            touched, stopped = self.outputs.process(events)
            self.scheduler.finish_requests(stopped + ended, FinishReason.STOP)
        self.block_manager.unhold_seqs(handle.held_seqs)
        decode_only = all(s.num_tokens == 1 for s in handle.sched.scheduled)
        self.meter.mark(self.runner.stream.busy_seconds(), decode_only and bool(touched))
        return touched

    def run_canary(self) -> list[tuple[int, float]]:
        """Greedy tokens with logprobs of a fixed prompt (idle engine only): a restored
        process must reproduce what was recorded before its checkpoint. Two tokens: one
        prefill (every weight) and one decode step (the paged path); each more token cost a
        tier-P start ~0.14 s under gVisor for the 0.49B model."""
        return self._greedy_probe([1, 2, 3, 4, 5, 6, 7], max_tokens=2, logprobs=0)

    def remap_weights_from_snapshot(self) -> bool:
        """Swap the weights for the tier-A snapshot's file-backed (mmapped) copy, when one
        matches: a process image then holds no weights. False if there is none."""
        if self.snapshot is None or self.has_unfinished_requests():
            return False
        old = self.runner.model
        swapped = self._restore_weights() and self.runner.model is not old
        if swapped:
            self._recapture_graphs()
        return swapped

    def resize_kv_cache(self, num_blocks: int) -> None:
        """Reallocate the KV pool with ``num_blocks`` blocks (idle engine only): shrunk before a
        process checkpoint so the image stays small, grown back after the restore."""
        if self.has_unfinished_requests():
            raise RuntimeError("resize_kv_cache needs an idle engine")
        self.runner.kv_caches = []  # NOTE: drop the old pool before allocating the new one
        self.runner.allocate_kv_cache(num_blocks)
        self.facts = replace(self.facts, num_kv_blocks=num_blocks)
        self._new_scheduler()
        self._recapture_graphs()

    def stats(self) -> dict:
        kv, graphs = self.block_manager, self.runner.graphs
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_blocks_total": kv.num_blocks,
            "kv_blocks_used": kv.num_used_blocks,
            "kv_usage": kv.usage,
            "prefix_cache_queries": kv.prefix_queries,
            "prefix_cache_hits": kv.prefix_hits,
            "preemptions": self.scheduler.num_preemptions,
            "loop": self.loop.name,
            "cuda_graphs": self.graphs_note,
            "graph_steps": None if graphs is None else sum(graphs.replays.values()),
            "bubble_fraction": self.meter.bubble_fraction,
            "decode_steps_measured": self.meter.steps,
            "launched_rows": self.meter.launched_rows,
            "startup_times": dict(self.startup_times),
        }


def _resolve_pipelined(pipelined: bool | None, device: torch.device) -> bool:
    """Default: pipelined on CUDA and on CPUs with >= 4 cores. On smaller CPUs the host thread
    would take a core from the matmuls, which costs more than the bubble it removes."""
    if pipelined is not None:
        return pipelined
    return device.type == "cuda" or (os.cpu_count() or 1) >= 4


def _resolve_cuda_graphs(cuda_graphs: bool | None, device: torch.device) -> bool:
    if cuda_graphs and device.type != "cuda":
        raise ValueError(f"cuda_graphs=True needs a CUDA device, not {device}")
    return device.type == "cuda" if cuda_graphs is None else cuda_graphs


def _cpu_threads(config: EngineConfig, device: torch.device, pipelined: bool) -> int | None:
    """On the CPU the "device" is an executor thread; pipelined leaves one core to the host."""
    if device.type != "cpu":
        return None
    threads = config.cpu_threads or max(1, (os.cpu_count() or 1) - int(pipelined))
    torch.set_num_threads(threads)  # the loading phases run on this thread
    return threads


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    return dev


def _resolve_dtype(name: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        ckpt = _DTYPES.get(cfg.checkpoint_dtype, torch.bfloat16)
        return torch.bfloat16 if ckpt == torch.float32 else ckpt
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; use auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


def wants_pretune(setting: bool | None, device: torch.device, backend: str, publishing: bool):
    """Whether start-up tunes the prefill kernel for every shape (``pretune_attention``)."""
    if device.type != "cuda" or backend != "triton":
        return False
    return publishing if setting is None else setting


def _attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """auto: Triton on CUDA, torch elsewhere. triton on the CPU needs Triton's interpreter."""
    if name not in ("auto", "torch", "triton"):
        raise ValueError(f"unknown attention_backend {name!r}; use auto, torch or triton")
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TorchAttentionBackend()
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise ValueError(
            "attention_backend='triton' on a CPU device runs only in Triton's interpreter: "
            "set TRITON_INTERPRET=1 before warmboot's kernels are imported (slow; for tests)"
        )
    # NOTE: imported here so the kernels are defined only when used (and after the env is set)
    from warmboot.kernels.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()


def _eos_ids(model_dir: Path, cfg: ModelConfig, tokenizer: Tokenizer) -> tuple[int, ...]:
    """EOS ids from generation_config.json, else config.json, plus the tokenizer's."""
    ids: list[int] = []
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
    if not ids:
        ids += list(cfg.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(ids))
