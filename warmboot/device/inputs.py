"""A step's host inputs: token ids, positions, KV slot mapping, block tables and the sampling
index, written into one of the two ping-pong working sets (rows ordered decodes first)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from warmboot.core.types import ScheduledRequest
from warmboot.device.graphs import DecodeGraphs
from warmboot.device.pools import StateMoves
from warmboot.device.slots import RequestSlots
from warmboot.device.staging import Staging, StepInputs, host_tensor
from warmboot.kernels.backend import AttentionMetadata, KVLayout, PrefillSeq
from warmboot.lora.registry import LoraRegistry
from warmboot.models.layers.rope import pack_position

if TYPE_CHECKING:
    from warmboot.models.base import CausalLM


class InputBuilder:
    def __init__(
        self,
        block_size: int,
        num_request_slots: int,
        max_model_len: int,
        max_tokens: int,
        max_rows: int,
        device: torch.device,
    ):
        self.block_size = block_size
        self.table_width = -(-max_model_len // block_size)
        self._tables = np.zeros((num_request_slots + 1, self.table_width), dtype=np.int64)
        """Host block tables per request slot, appended as tables grow (decode rows copy
        theirs in C, not per block in Python); the last row is the graph padding row."""
        self._table_len: dict[str, int] = {}
        """Per request: entries of its table already in ``_tables``."""
        self._pin = device.type == "cuda"
        self.staging = [
            Staging(max_tokens, max_rows, self.table_width, self._pin) for _ in range(2)
        ]
        self.scratch_block = 0
        """KV block past the managed pool, written only by graph padding rows."""
        self.with_states = False
        """The model has state layers: each sequence's state slot goes into the metadata."""
        self.rope_lengths = False
        """The model's rope depends on the sequence length (``models.layers.rope``): each
        position carries its request's prompt length in its high bits."""
        self.lora: LoraRegistry | None = None
        """With LoRA on: the adapters, whose device slots each step's plan takes."""

    def adopt(self, model: CausalLM, layout: KVLayout) -> None:
        """What ``model``'s steps need in their inputs (its state layers, its rope)."""
        self.with_states = layout.has_state
        self.rope_lengths = any(r.spec.length_dependent for r in model.rotary_embeddings())

    def reset_tables(self, scratch_block: int) -> None:
        """A new KV pool whose scratch block is ``scratch_block``."""
        # NOTE: a table row's columns past its length are read (masked) by the torch backend:
        # ids left from an earlier, larger pool would index past this one
        self._tables.fill(0)
        self._table_len.clear()
        self._tables[-1] = scratch_block
        self.scratch_block = scratch_block

    def forget_table(self, req_id: str) -> None:
        self._table_len.pop(req_id, None)

    @property
    def host_tables(self) -> np.ndarray:
        """A copy of the host block tables, one row per request slot (the last row: graph
        padding)."""
        return self._tables.copy()

    def build(
        self,
        scheduled: list[ScheduledRequest],
        buffer: int,
        slots: RequestSlots,
        graphs: DecodeGraphs | None,
    ) -> StepInputs:
        """The step's inputs, written into the ping-pong working set ``buffer``."""
        bs, staging = self.block_size, self.staging[buffer]
        rows = sorted(scheduled, key=lambda s: s.num_tokens != 1)  # decodes first, stable
        ids, positions, kv_slots, last_index = self._tokens(rows)
        num_decodes = sum(1 for s in rows if s.num_tokens == 1)
        width = max((len(s.block_table) for s in rows[:num_decodes]), default=0)
        graph_batch = _graph_batch(graphs, len(rows), num_decodes, width)
        pad = graph_batch - num_decodes if graph_batch else 0
        if pad:  # padding rows of a graph step: token 0 at the scratch slot, one key
            ids += [0] * pad
            positions += [0] * pad
            kv_slots += [self.scratch_block * bs] * pad
        meta = AttentionMetadata(
            slot_mapping=staging.put("slots", kv_slots),
            num_decode_tokens=num_decodes + pad,
            decode_block_tables=None,
            decode_seq_lens=None,
            prefills=self._prefills(rows[num_decodes:], num_decodes),
            block_size=bs,
        )
        if num_decodes:
            decodes = rows[:num_decodes]
            meta.decode_block_tables = self._decode_tables(staging, decodes, pad, width, slots)
            lens = [s.start_pos + 1 for s in decodes] + [1] * pad
            meta.decode_seq_lens = staging.put("seq_lens", lens)
        moves = self._state_slots(meta, staging, rows, num_decodes, slots)
        sampling = [i for i, s in enumerate(rows) if s.sample]
        step = StepInputs(
            rows=rows,
            input_ids=staging.put("ids", ids),
            positions=staging.put("positions", positions),
            meta=meta,
            sample_rows=[rows[i] for i in sampling],
            sample_index=staging.put("sample_index", [last_index[i] for i in sampling]),
            last_index=last_index,
            graph_batch=graph_batch,
            state_moves=moves,
            lora=self.lora.plan([(s.lora, s.num_tokens) for s in rows]) if self.lora else None,
        )
        if any(s.prompt_logprob_targets for s in rows):
            self._prompt_rows(step)
        return step

    def _state_slots(
        self,
        meta: AttentionMetadata,
        staging: Staging,
        rows: list[ScheduledRequest],
        num_decodes: int,
        slots: RequestSlots,
    ) -> StateMoves:
        """Each sequence's state slot (its request slot) into ``meta``, with the prefills'
        midway saves; returns the step's copies between state rows (``StateMoves``)."""
        moves = StateMoves()
        if not self.with_states:
            return moves
        meta.state_slots = [slots.slot_of(s.req_id) for s in rows]
        if num_decodes:
            meta.decode_state_slots = staging.put("state_slots", meta.state_slots[:num_decodes])
        for s, slot in zip(rows, meta.state_slots, strict=True):
            if s.state_load is not None:
                moves.load.append((s.state_load, slot))
            elif s.start_pos == 0:
                moves.clear.append(slot)
            moves.keep += [(slot, row) for at, row in s.state_saves if at == s.num_tokens]
        midway = [tuple(c for c in s.state_saves if c[0] < s.num_tokens) for s in rows]
        if any(midway):
            meta.state_saves = midway[num_decodes:]
        return moves

    def _prompt_rows(self, step: StepInputs) -> None:
        """Where in the batch the rows that want prompt logprobs predict which tokens."""
        index: list[int] = []
        targets: list[int] = []
        for s, last in zip(step.rows, step.last_index, strict=True):
            if not s.prompt_logprob_targets:
                continue
            first = last - s.num_tokens + 1 + s.prompt_logprobs_from
            count = len(s.prompt_logprob_targets)
            index.extend(range(first, first + count))
            targets.extend(s.prompt_logprob_targets)
            step.prompt_rows.append((s.req_id, count, s.params.prompt_logprobs))
        step.prompt_index = host_tensor(index, self._pin)
        step.prompt_targets = host_tensor(targets, self._pin)

    def _tokens(self, rows: list[ScheduledRequest]):
        """(ids, positions, KV slots, per row the index of its last token)."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        kv_slots: list[int] = []
        last_index: list[int] = []
        for s in rows:
            table = s.block_table
            for pos in range(s.start_pos, s.start_pos + s.num_tokens):
                kv_slots.append(table[pos // bs] * bs + pos % bs)
            span = range(s.start_pos, s.start_pos + s.num_tokens)
            if self.rope_lengths:
                span = [pack_position(p, len(s.prompt_token_ids)) for p in span]
            positions.extend(span)
            ids.extend(s.token_ids)
            last_index.append(len(ids) - 1)
        return ids, positions, kv_slots, last_index

    def _prefills(self, rows: list[ScheduledRequest], start: int) -> list[PrefillSeq]:
        bs, out = self.block_size, []
        for s in rows:
            ctx = s.start_pos + s.num_tokens
            table = host_tensor(s.block_table[: -(-ctx // bs)], self._pin)
            out.append(PrefillSeq(start, s.num_tokens, ctx, table))
            start += s.num_tokens
        return out

    def _decode_tables(
        self,
        staging: Staging,
        decodes: list[ScheduledRequest],
        pad: int,
        width: int,
        slots: RequestSlots,
    ) -> torch.Tensor:
        """(rows + pad, ``width``: the widest table) host tensor from the per-slot tables,
        after appending each row's new blocks; padding rows point at the scratch block."""
        tables = self._tables
        rows = []
        for s in decodes:
            slot = slots.slot_of(s.req_id)
            known = self._table_len.get(s.req_id, 0)
            if len(s.block_table) > known:
                tables[slot, known : len(s.block_table)] = s.block_table[known:]
                self._table_len[s.req_id] = len(s.block_table)
            rows.append(slot)
        return staging.tables(tables, rows + [len(tables) - 1] * pad, width)


def _graph_batch(
    graphs: DecodeGraphs | None, num_rows: int, num_decodes: int, width: int
) -> int | None:
    """The graph bucket of a decode-only step whose widest table is ``width``, or None
    (eager)."""
    if graphs is None or not num_rows or num_decodes != num_rows or width > graphs.width:
        return None
    return graphs.bucket(num_decodes)
