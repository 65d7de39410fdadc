"""The ops of state layers (hybrid models' linear attention, SSM and short-conv layers) over
a step's rows, each sequence continuing from the state it keeps in its state slot.

A step's rows are its decodes (one token each), then its prefill chunks (``AttentionMetadata``).
The decode rows run the one-token recurrence together, their states gathered from their slots
and scattered back; each prefill chunk runs the chunked form from its slot's state and leaves
its final state there. A sequence that starts at position 0 starts from zeros: the runner clears
its slot before the step (``ModelRunner``), so a chunked prefill, a preempted request computed
again and a batch of unequal lengths all give the tokens of one whole-prompt forward.

- ``warmboot::causal_conv(x, weight, bias, layer, activation)``: a depthwise causal conv1d over
  the last ``K - 1`` inputs kept as the layer's ``conv`` state.
- ``warmboot::gated_delta(q, k, v, g, beta, layer, scale)``: the gated delta rule over the
  layer's ``recurrent`` state (Qwen3-Next, Qwen3.5).
- ``warmboot::kda(q, k, v, g, beta, layer, scale)``: the same rule with a decay per key
  channel (``g`` shaped as ``k``) over the layer's ``recurrent`` state (Kimi Linear).
- ``warmboot::ssd(x, dt, A, B, C, D, layer, chunk_size)``: Mamba 2's state space over the
  layer's ``recurrent`` state.
- ``warmboot::selective_scan(x, dt, A, B, C, D, layer)``: Mamba 1's selective scan (a decay
  per channel and state index) over the layer's ``recurrent`` state (Mamba, Jamba).
- ``warmboot::lightning(q, k, v, slope, layer)``: linear attention with a fixed decay per head
  over the layer's ``recurrent`` state (MiniMax's lightning attention).

A compiled step calls them as opaque ops with the layer's number (``STEP_INDEX``), as it calls
``paged_attention``; an eager step calls the same functions through its ``StepContext``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from warmboot.kernels import lightning as lightning_attention
from warmboot.kernels import recurrent, state_steps
from warmboot.kernels.selective_scan import selective_scan_chunk, selective_scan_step
from warmboot.kernels.step_ops import STEP_INDEX, StepContext, _context

Decode = Callable[..., torch.Tensor]
Prefill = Callable[..., torch.Tensor]


def _over_rows(
    ctx: StepContext, tensors: tuple, decode: Decode, prefill: Prefill, kept: tuple
) -> torch.Tensor:
    """``decode(slots, *rows)`` over the decode rows and ``prefill(slot, *rows)`` per prefill
    chunk, concatenated in the step's row order (contiguous, as the ops' fakes say).

    ``kept``: the state tensors the op writes (rows: slots, then checkpoint rows). A prefill
    with midway saves (``AttentionMetadata.state_saves``, for the prefix cache) runs in pieces
    that each continue from the slot's state, copying ``kept``'s slot row into the checkpoint
    row after each piece; so every op of a state layer must pass all it writes."""
    meta = ctx.meta
    if meta is None:
        raise RuntimeError("a state layer ran in a step without attention metadata")
    d = meta.num_decode_tokens
    outs = []
    if d:
        outs.append(decode(meta.decode_state_slots, *(t[:d] for t in tensors)))
    saves = meta.state_saves or [()] * len(meta.prefills)
    for p, slot, cuts in zip(meta.prefills, meta.state_slots[d:], saves, strict=True):
        start = p.query_start
        for at, row in cuts:
            outs.append(prefill(slot, *(t[start : p.query_start + at] for t in tensors)))
            for state in kept:
                state[row].copy_(state[slot])
            start = p.query_start + at
        end = p.query_start + p.query_len
        outs.append(prefill(slot, *(t[start:end] for t in tensors)))
    return outs[0].contiguous() if len(outs) == 1 else torch.cat(outs)


def conv(
    ctx: StepContext,
    layer: int,
    x: torch.Tensor,  # (N, C)
    weight: torch.Tensor,  # (C, K)
    bias: torch.Tensor | None,
    activation: str | None,
) -> torch.Tensor:  # (N, C)
    cache = ctx.states[layer]["conv"]  # (slots, C, K - 1)

    def decode(slots: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        y = state_steps.conv_step(cache, slots, x, weight, bias, activation)
        if y is not None:  # NOTE: in place on the slots' rows (no gather/scatter)
            return y
        state = cache[slots]
        y = recurrent.causal_conv1d_step(x, weight, bias, state, activation)
        cache[slots] = state
        return y

    def prefill(slot: int, x: torch.Tensor) -> torch.Tensor:
        y, state = recurrent.causal_conv1d(x, weight, bias, cache[slot], activation)
        cache[slot].copy_(state)
        return y

    return _over_rows(ctx, (x,), decode, prefill, (cache,))


def gated_delta(ctx: StepContext, layer: int, q, k, v, g, beta, scale: float) -> torch.Tensor:
    """q, k (N, H, Dk) not yet L2-normalised, v (N, H, Dv), g (N, H) log decay, beta (N, H)
    -> (N, H, Dv), over the layer's ``recurrent`` state (slots, H, Dk, Dv) float32."""
    step, chunked = recurrent.recurrent_gated_delta_step, recurrent.chunk_gated_delta_rule
    fused = state_steps.gated_delta_step
    return _delta_rule(ctx, layer, (q, k, v, g, beta), scale, step, chunked, fused)


def kda(ctx: StepContext, layer: int, q, k, v, g, beta, scale: float) -> torch.Tensor:
    """As ``gated_delta`` with ``g`` (N, H, Dk): a log decay per key channel (Kimi)."""
    step, chunked = recurrent.recurrent_kda_step, recurrent.chunk_kda
    fused = state_steps.kda_step
    return _delta_rule(ctx, layer, (q, k, v, g, beta), scale, step, chunked, fused)


def _delta_rule(
    ctx, layer: int, rows: tuple, scale: float, step, chunked, fused=None
) -> torch.Tensor:
    """A delta rule's decode rows through ``step`` and each prefill through ``chunked``, from
    and back into the layer's ``recurrent`` state."""
    cache = ctx.states[layer]["recurrent"]

    def decode(slots: torch.Tensor, *rows: torch.Tensor) -> torch.Tensor:
        o = fused(cache, slots, *rows, scale) if fused is not None else None
        if o is not None:  # NOTE: the native step, in place on the slots' rows
            return o
        state = cache[slots]
        o = step(*rows, state, scale)
        cache[slots] = state
        return o

    def prefill(slot: int, *rows: torch.Tensor) -> torch.Tensor:
        o, state = chunked(*rows, cache[slot], scale)
        cache[slot].copy_(state)
        return o

    return _over_rows(ctx, rows, decode, prefill, (cache,))


def ssd(
    ctx: StepContext,
    layer: int,
    x: torch.Tensor,  # (N, H, P)
    dt: torch.Tensor,  # (N, H), softplus'd and clamped
    A: torch.Tensor,  # (H,)
    B: torch.Tensor,  # (N, G, S)
    C: torch.Tensor,  # (N, G, S)
    D: torch.Tensor,  # (H,)
    chunk_size: int,
) -> torch.Tensor:  # (N, H, P)
    cache = ctx.states[layer]["recurrent"]  # (slots, H, P, S) float32

    def decode(slots: torch.Tensor, x, dt, B, C) -> torch.Tensor:
        y = state_steps.ssd_step(cache, slots, x, dt, A, B, C, D)
        if y is not None:
            return y
        state = cache[slots]
        y = recurrent.ssd_step(x, dt, A, B, C, D, state)
        cache[slots] = state
        return y

    def prefill(slot: int, x, dt, B, C) -> torch.Tensor:
        y, state = recurrent.ssd_chunk_scan(x, dt, A, B, C, D, cache[slot], chunk_size)
        cache[slot].copy_(state)
        return y

    return _over_rows(ctx, (x, dt, B, C), decode, prefill, (cache,))


def selective_scan(
    ctx: StepContext,
    layer: int,
    x: torch.Tensor,  # (N, d_inner)
    dt: torch.Tensor,  # (N, d_inner), softplus'd
    A: torch.Tensor,  # (d_inner, d_state)
    B: torch.Tensor,  # (N, d_state)
    C: torch.Tensor,  # (N, d_state)
    D: torch.Tensor,  # (d_inner,)
) -> torch.Tensor:  # (N, d_inner)
    cache = ctx.states[layer]["recurrent"]  # (slots, d_inner, d_state) float32

    def decode(slots: torch.Tensor, x, dt, B, C) -> torch.Tensor:
        state = cache[slots]
        y = selective_scan_step(x, dt, A, B, C, D, state)
        cache[slots] = state
        return y

    def prefill(slot: int, x, dt, B, C) -> torch.Tensor:
        y, state = selective_scan_chunk(x, dt, A, B, C, D, cache[slot])
        cache[slot].copy_(state)
        return y

    return _over_rows(ctx, (x, dt, B, C), decode, prefill, (cache,))


def lightning(ctx: StepContext, layer: int, q, k, v, slope: torch.Tensor) -> torch.Tensor:
    """q, k, v (N, H, D), slope (H,) the per-head decay rates -> (N, H, D), over the layer's
    ``recurrent`` state (slots, H, D, D) float32; run as the delta rules are."""
    step, chunked = lightning_attention.lightning_step, lightning_attention.lightning_prefill
    return _delta_rule(ctx, layer, (q, k, v), slope, step, chunked)


# -- the ops a compiled step calls (declared functional: their one side effect, the state
# write, is on tensors the graph never sees, as paged_attention's KV write) ---------------------
_LIB = torch.library.Library("warmboot", "FRAGMENT")
_LIB.define(
    "causal_conv(Tensor x, Tensor weight, Tensor? bias, Tensor layer, str? activation) -> Tensor"
)
_LIB.define(
    "gated_delta(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor layer, float scale)"
    " -> Tensor"
)
_LIB.define(
    "kda(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor layer, float scale) -> Tensor"
)
_LIB.define("lightning(Tensor q, Tensor k, Tensor v, Tensor slope, Tensor layer) -> Tensor")
_LIB.define(
    "ssd(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor D, Tensor layer,"
    " int chunk_size) -> Tensor"
)
_LIB.define(
    "selective_scan(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor D, Tensor layer)"
    " -> Tensor"
)


def _conv_op(x, weight, bias, layer, activation):
    return conv(_context("causal_conv"), int(layer), x, weight, bias, activation)


def _gated_delta_op(q, k, v, g, beta, layer, scale):
    return gated_delta(_context("gated_delta"), int(layer), q, k, v, g, beta, scale)


def _kda_op(q, k, v, g, beta, layer, scale):
    return kda(_context("kda"), int(layer), q, k, v, g, beta, scale)


def _lightning_op(q, k, v, slope, layer):
    return lightning(_context("lightning"), int(layer), q, k, v, slope)


def _ssd_op(x, dt, A, B, C, D, layer, chunk_size):
    return ssd(_context("ssd"), int(layer), x, dt, A, B, C, D, chunk_size)


def _selective_scan_op(x, dt, A, B, C, D, layer):
    return selective_scan(_context("selective_scan"), int(layer), x, dt, A, B, C, D)


_LIB.impl("causal_conv", _conv_op, "CompositeExplicitAutograd")
_LIB.impl("gated_delta", _gated_delta_op, "CompositeExplicitAutograd")
_LIB.impl("kda", _kda_op, "CompositeExplicitAutograd")
_LIB.impl("ssd", _ssd_op, "CompositeExplicitAutograd")
_LIB.impl("selective_scan", _selective_scan_op, "CompositeExplicitAutograd")
_LIB.impl("lightning", _lightning_op, "CompositeExplicitAutograd")


@torch.library.register_fake("warmboot::causal_conv")
def _(x, weight, bias, layer, activation):
    return x.new_empty(x.shape)


@torch.library.register_fake("warmboot::gated_delta")
def _(q, k, v, g, beta, layer, scale):
    return v.new_empty(v.shape)


@torch.library.register_fake("warmboot::kda")
def _(q, k, v, g, beta, layer, scale):
    return v.new_empty(v.shape)


@torch.library.register_fake("warmboot::ssd")
def _(x, dt, A, B, C, D, layer, chunk_size):
    return x.new_empty(x.shape)


@torch.library.register_fake("warmboot::selective_scan")
def _(x, dt, A, B, C, D, layer):
    return x.new_empty(x.shape)


@torch.library.register_fake("warmboot::lightning")
def _(q, k, v, slope, layer):
    return v.new_empty(v.shape)


# -- what a state layer calls: the op in a compiled step, the function in an eager one ---------
def layer_index(module: torch.nn.Module) -> torch.Tensor | None:
    """A packed view's state layer carries its decoder layer's number (``STEP_INDEX``)."""
    return getattr(module, STEP_INDEX, None)


def call_conv(module, step, x, weight, bias, activation):
    index = layer_index(module)
    if index is not None:
        return torch.ops.warmboot.causal_conv(x, weight, bias, index, activation)
    return conv(step, step.layer, x, weight, bias, activation)


def call_gated_delta(module, step, q, k, v, g, beta, scale: float):
    index = layer_index(module)
    if index is not None:
        return torch.ops.warmboot.gated_delta(q, k, v, g, beta, index, scale)
    return gated_delta(step, step.layer, q, k, v, g, beta, scale)


def call_kda(module, step, q, k, v, g, beta, scale: float):
    index = layer_index(module)
    if index is not None:
        return torch.ops.warmboot.kda(q, k, v, g, beta, index, scale)
    return kda(step, step.layer, q, k, v, g, beta, scale)


def call_ssd(module, step, x, dt, A, B, C, D, chunk_size: int):
    index = layer_index(module)
    if index is not None:
        return torch.ops.warmboot.ssd(x, dt, A, B, C, D, index, chunk_size)
    return ssd(step, step.layer, x, dt, A, B, C, D, chunk_size)


def call_selective_scan(module, step, x, dt, A, B, C, D):
    index = layer_index(module)
    if index is not None:
        return torch.ops.warmboot.selective_scan(x, dt, A, B, C, D, index)
    return selective_scan(step, step.layer, x, dt, A, B, C, D)


def call_lightning(module, step, q, k, v, slope):
    index = layer_index(module)
    if index is not None:
        return torch.ops.warmboot.lightning(q, k, v, slope, index)
    return lightning(step, step.layer, q, k, v, slope)
