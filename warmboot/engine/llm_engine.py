"""The engine: ``add_request`` (validated once), ``abort_request``, ``step`` and ``stats``
over the parts that ``Startup`` booted; the loop owns what a step does."""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import replace

from warmboot.config import EngineConfig
from warmboot.core.block_manager import BlockManager
from warmboot.core.errors import InvalidRequestError
from warmboot.core.output_processor import CompletionState, OutputProcessor, RequestGroup
from warmboot.core.request import FinishReason, Request
from warmboot.core.scheduler import Scheduler
from warmboot.core.state_prefix import StatePrefix
from warmboot.device.grammar_requests import GrammarRequests
from warmboot.engine.loop import StepParts, make_loop
from warmboot.engine.startup import Startup
from warmboot.engine.validation import Prompt, RequestValidator, ValidatedRequest
from warmboot.lora.adapter import LoraError
from warmboot.lora.registry import LoraRegistry
from warmboot.lora.targets import Resolved
from warmboot.lora_request import LoRARequest
from warmboot.outputs import RequestOutput
from warmboot.sampling_params import SamplingParams
from warmboot.snapshot.canary import run_canary

__all__ = ["InvalidRequestError", "LLMEngine", "Prompt", "ValidatedRequest"]


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.startup = Startup(config)
        booted = self.startup.boot()
        self.model_config, self.settings = booted.model_config, booted.settings
        self.sched_config = booted.settings.scheduler
        self.pipelined = booted.settings.pipelined
        self.tokenizer, self.runner, self.facts = booted.tokenizer, booted.runner, booted.facts
        tokenizer_json = self.startup.model_dir / "tokenizer.json"
        vocab = self.model_config.vocab_size
        self.grammars = GrammarRequests(tokenizer_json, vocab, self.facts.eos_token_ids)
        self.validator = RequestValidator(
            self.tokenizer, vocab, self.sched_config.max_model_len, self.grammars
        )
        self._ids = itertools.count()
        self._submissions = itertools.count()
        self._new_core()
        self.start_info = self.startup.finish(self)

    def _new_core(self) -> None:
        """A fresh block manager, scheduler, output processor and loop (idle engine)."""
        cache = self.config.cache
        prefix_caching = cache.enable_prefix_caching and self.prefix_caching_off is None
        kv = BlockManager(self.facts.num_kv_blocks, cache.block_size, prefix_caching)
        rows = self.runner.checkpoint_rows
        prefix = StatePrefix(kv, rows) if rows and prefix_caching else None
        self.block_manager = kv
        self.scheduler = Scheduler(self.sched_config, kv, prefix)
        self.outputs = OutputProcessor(self.tokenizer)
        parts = StepParts(
            self.scheduler, self.block_manager, self.runner, self.grammars, self.outputs
        )
        self.loop = make_loop(parts, self.pipelined)
        if self.lora is not None:  # NOTE: an adapter live requests use is never evicted
            requests = self.scheduler.requests  # NOTE: list() copies it whole, under the GIL
            self.lora.in_use = lambda: {r.lora for r in list(requests.values())}

    @property
    def lora(self) -> LoraRegistry | None:
        """The adapters (``enable_lora``), else None."""
        return self.runner.inputs.lora

    @property
    def prefix_caching_off(self) -> str | None:
        """Why prefix caching is off for this model whatever the settings, or None."""
        if self.runner.kv_layout.has_state and not self.runner.checkpoint_rows:
            return (
                "state layers without kept states (state_checkpoints=0): a cached prefix's KV "
                "would not restore their per-request state, so every prompt is computed in full"
            )
        return None

    # -- requests ------------------------------------------------------------------------------
    def validate(self, prompt: Prompt, params: SamplingParams) -> ValidatedRequest:
        """Tokenize and check a request; raise ``InvalidRequestError`` naming the problem."""
        return self.validator.validate(prompt, params)

    def add_request(
        self,
        request_id: str | None,
        prompt: Prompt | ValidatedRequest,
        params: SamplingParams | None = None,
        group: str | None = None,
        client: str = "",
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Queue a request (validated here unless ``prompt`` is a ``ValidatedRequest``); raise
        ``InvalidRequestError`` (nothing queued) if bad. ``group``: the API call it is part of
        (the server's id of it), ``client``: who sent it. The scheduler takes turns between
        clients, then between a client's calls, each prompt and completion of a call one
        sequence (``core.fair_queue``); no group: a call of its own. ``lora_request``: the
        adapter it runs with (``enable_lora``), read on first use."""
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.outputs.groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, ValidatedRequest):
            if params is not None and params is not prompt.params:
                raise InvalidRequestError("a validated request comes with its own params")
            checked = prompt
        else:
            checked = self.validate(prompt, params or SamplingParams())
        adapter = self._adapter(lora_request)
        children, states = self._children(request_id, checked, group, client, adapter)
        outputs = RequestGroup(request_id, checked.text, list(checked.token_ids), states, children)
        self.outputs.add(outputs)
        for child in children:
            if checked.params.structured_outputs is not None:
                self.grammars.add(child.request_id, checked.params.structured_outputs)
            self.scheduler.add_request(child)
        return request_id

    def check_lora(self, lora_request: LoRARequest) -> None:
        """Read and check ``lora_request``'s adapter now (``InvalidRequestError``)."""
        self._adapter(lora_request)

    def _adapter(self, lora_request: LoRARequest | None) -> Resolved | None:
        """The request's adapter, read and checked on first use; ``InvalidRequestError``
        naming what is wrong (LoRA off, a bad adapter)."""
        if lora_request is None:
            return None
        if self.lora is None:
            raise InvalidRequestError("a lora_request needs an engine with enable_lora=True")
        try:
            return self.lora.add(lora_request)
        except (LoraError, OSError) as e:
            raise InvalidRequestError(str(e)) from None

    def _children(
        self,
        request_id: str,
        checked: ValidatedRequest,
        group: str | None,
        client: str,
        adapter: Resolved | None = None,
    ):
        """One ``Request`` and its output state per completion (``n``)."""
        params, eos = checked.params, frozenset(self.facts.eos_token_ids)
        # NOTE: internal ids are unique per submission, so a user id reused while a zombie row
        # of its previous request is still in flight never collides with it.
        submission, prompt = next(self._submissions), tuple(checked.token_ids)
        root = self.runner.model.prefix_root(len(prompt))
        if adapter is not None:  # NOTE: its KV is the adapter's: a cache chain of its own
            root = hashlib.blake2b((root or b"") + adapter.digest.encode()).digest()
        children: list[Request] = []
        states = []
        for i in range(params.n):
            child_params = params if params.seed is None else replace(params, seed=params.seed + i)
            child = Request(
                request_id=f"{request_id}#{i}@{submission}",
                prompt_token_ids=prompt,
                params=child_params,
                max_tokens=checked.max_tokens,
                eos_token_ids=eos,
                leader=children[0] if children else None,
                completion_index=i,
                group=group,
                client=client,
                prefix_root=root,
                lora=None if adapter is None else adapter.name,
            )
            children.append(child)
            logprobs = [] if params.logprobs is not None else None
            detok = self.tokenizer.detokenizer(
                params.skip_special_tokens, params.spaces_between_special_tokens
            )
            states.append(CompletionState(i, child_params, detok, logprobs=logprobs))
        return children, states

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
                self.grammars.drop([c.request_id for c in group.children])
        return outputs

    def stats(self) -> dict:
        kv, graphs, meter = self.block_manager, self.runner.graphs, self.loop.meter
        arms = getattr(self.runner.stream, "arms", None)  # NOTE: CPU helper threads only
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_blocks_total": kv.num_blocks,
            "kv_bytes_per_token": self.facts.kv_bytes_per_token,
            "kv_cache_bytes": kv.num_blocks * kv.block_size * self.facts.kv_bytes_per_token,
            "kv_blocks_used": kv.num_used_blocks,
            "kv_usage": kv.usage,
            "prefix_cache_queries": kv.prefix_queries,
            "prefix_cache_hits": kv.prefix_hits,
            "prefix_caching_off": self.prefix_caching_off,
            **self.runner.state_stats(),
            "state_checkpoints_kept": self.scheduler.prefix.num_kept,
            "state_prefix_hits": self.scheduler.prefix.loads,
            "preemptions": self.scheduler.num_preemptions,
            "express_steps": self.scheduler.num_express,
            "shared_steps": self.scheduler.shared.steps,
            "loop": self.loop.name,
            "cuda_graphs": self.startup.graphs_note,
            "compile": dict(self.startup.compiling.info),
            "graph_steps": None if graphs is None else sum(graphs.replays.values()),
            "steps_served": dict(self.runner.served),
            "bubble_fraction": meter.bubble_fraction,
            "helper_steps": None if arms is None else arms.steps,
            "decode_steps_measured": meter.steps,
            "launched_rows": meter.launched_rows,
            "startup_times": dict(self.startup_times),
            "grammar": self.grammars.compiles.stats(),
        }

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait until a restore's background compile is done (see ``Startup.compile``)."""
        return self.startup.wait_compiled(timeout)

    # -- idle-engine operations (tests, the tier-P worker) -----------------------------------
    @property
    def startup_times(self) -> dict[str, float]:
        return self.startup.times

    @property
    def snapshot(self):
        return self.startup.snapshot

    def enable_decode_graphs(
        self, batch_sizes: tuple[int, ...] | None = None, emulate: bool = False
    ) -> None:
        """Capture decode steps as CUDA graphs for ``batch_sizes`` (default: 1, 2, 4, 8,
        multiples of 16 up to ``max_num_seqs``). ``emulate``: run the graph path eagerly (CPU
        tests: static buffers and padding without a capture). Idle engine only."""
        self.startup.enable_graphs(self, batch_sizes, emulate)

    def run_canary(self) -> list[tuple[int, float]]:
        """Greedy tokens with logprobs of the canary prompt (idle engine only): a restored
        process must reproduce what was recorded before its checkpoint."""
        return run_canary(self)

    def remap_weights_from_snapshot(self) -> dict[str, int]:
        """Swap the weights for the tier-A snapshot's file-backed (mmapped) copy, when one
        matches: a process image then holds no weights. Returns the chunks now mapped (hash ->
        size; the process manifest lists them so no ``rm`` collects them), empty if none."""
        snap = self.startup.snapshot
        if snap is None or self.has_unfinished_requests():
            return {}
        old = self.runner.model
        swapped = self.startup.restore_weights(self.runner, mapped=True)
        if not swapped or self.runner.model is old or snap.manifest is None:
            return {}
        self.startup.wait_compiled()
        self.startup.compile(self, again=True)
        self.startup.recapture_graphs(self)
        return snap.manifest.chunk_refs()

    def resize_kv_cache(self, num_blocks: int) -> None:
        """Reallocate the KV pool with ``num_blocks`` blocks (idle engine only): shrunk before a
        process checkpoint so the image stays small, grown back after the restore."""
        if self.has_unfinished_requests():
            raise RuntimeError("resize_kv_cache needs an idle engine")
        self.runner.allocate_kv_cache(num_blocks, len(self.runner.checkpoint_rows))
        self.facts = replace(self.facts, num_kv_blocks=num_blocks)
        self._new_core()
        self.startup.recapture_graphs(self)
