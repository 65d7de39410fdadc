"""The model runner owns every device tensor (weights, KV cache, per-request generators) and
turns a ``SchedulerOutput`` into a ``RunnerOutput``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from warmboot.config import ModelConfig
from warmboot.engine.sampler import Sampler, SamplerOutput, SamplingRow, make_generator
from warmboot.engine.scheduler import RunnerOutput, ScheduledRequest, SchedulerOutput, TokenLogprobs
from warmboot.kernels.backend import AttentionBackend, AttentionMetadata, PrefillSeq
from warmboot.models.decoder import DecoderModel
from warmboot.models.loader import load_model


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


class ModelRunner:
    def __init__(
        self,
        model_cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        attention: AttentionBackend,
        block_size: int,
    ):
        self.model_cfg = model_cfg
        self.dtype = dtype
        self.device = device
        self.attention = attention
        self.block_size = block_size
        self.model: DecoderModel | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator] = {}

    # -- start-up phases -----------------------------------------------------------------------
    def load_model(self, model_dir: str | Path) -> None:
        self.model = load_model(model_dir, self.model_cfg, self.dtype, self.device)

    def kv_bytes_per_block(self) -> int:
        cfg = self.model_cfg
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * cfg.num_layers * self.block_size * cfg.kv_size * elem

    def allocate_kv_cache(self, num_blocks: int) -> None:
        cfg = self.model_cfg
        shape = (cfg.num_layers, 2, num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.kv_caches = [(cache[i, 0], cache[i, 1]) for i in range(cfg.num_layers)]

    # -- step ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        for req_id in sched.finished_req_ids:
            self._generators.pop(req_id, None)
        # NOTE: a preempted request keeps its generator: its random stream continues.
        if sched.is_empty:
            return RunnerOutput([], [])
        step = self.prepare(sched.scheduled)
        hidden = self.model(
            step.input_ids, step.positions, self.kv_caches, step.meta, self.attention
        )
        if not step.sample_rows:
            return RunnerOutput([], [])
        logits = self.model.compute_logits(hidden[step.sample_index])
        rows = [self._sampling_row(s) for s in step.sample_rows]
        return self._to_output(step.sample_rows, self.sampler(logits, rows))

    def prepare(self, scheduled: list[ScheduledRequest]) -> StepInputs:
        bs = self.block_size
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
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            num_decode_tokens=num_decodes,
            decode_block_tables=None,
            decode_seq_lens=None,
            prefills=[],
            block_size=bs,
        )
        if num_decodes:
            decodes = rows[:num_decodes]
            width = max(len(s.block_table) for s in decodes)
            tables = [s.block_table + [0] * (width - len(s.block_table)) for s in decodes]
            meta.decode_block_tables = torch.tensor(tables, dtype=torch.int64, device=dev)
            meta.decode_seq_lens = torch.tensor(
                [s.start_pos + 1 for s in decodes], dtype=torch.int64, device=dev
            )
        start = num_decodes
        for s in rows[num_decodes:]:
            ctx = s.start_pos + s.num_tokens
            table = torch.tensor(s.block_table[: -(-ctx // bs)], dtype=torch.int64, device=dev)
            meta.prefills.append(PrefillSeq(start, s.num_tokens, ctx, table))
            start += s.num_tokens
        sampling = [i for i, s in enumerate(rows) if s.sample]
        return StepInputs(
            rows=rows,
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            meta=meta,
            sample_rows=[rows[i] for i in sampling],
            sample_index=torch.tensor([last_index[i] for i in sampling], device=dev),
        )

    def _sampling_row(self, s: ScheduledRequest) -> SamplingRow:
        gen = None
        if s.params.seed is not None:
            gen = self._generators.get(s.req_id)
            if gen is None:
                gen = self._generators[s.req_id] = make_generator(s.params.seed, self.device)
        return SamplingRow(
            params=s.params,
            prompt_token_ids=s.prompt_token_ids,
            output_token_ids=s.output_token_ids,
            generator=gen,
            suppress_token_ids=s.suppress_token_ids,
        )

    @staticmethod
    def _to_output(rows: list[ScheduledRequest], out: SamplerOutput) -> RunnerOutput:
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
