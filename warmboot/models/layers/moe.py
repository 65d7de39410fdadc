"""Mixture-of-experts layers: a router that picks each token's experts, a layer's experts as
stacked weights run as one grouped step, and the sparse block that adds shared experts.

The grouped step sorts the step's (token, expert) pairs by expert once, then runs one
gate/up GEMM and one down GEMM per *active* expert over all of its tokens: the work follows
the experts the tokens chose, never the number of experts. How the two GEMMs are computed is
the experts' *method* (``ExpertsMethod``), the seam ``Linear`` has for dense weights: dense
here; the compiled step swaps in ``OpExperts``, an opaque op over the experts' weights packed
for oneDNN (``kernels.step_ops.ExpertTable``); quantized experts plug in the same way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from warmboot.kernels.experts import grouped_experts
from warmboot.models.layers.activation import activation
from warmboot.models.layers.linear import Linear


class Router(Linear):
    """Scores the experts (a linear map) and picks each token's ``top_k``:
    ``(N, H) -> (weights (N, k) in x's dtype, expert ids (N, k) int64)``.

    - ``scoring``: "softmax" (Mixtral, Qwen-MoE, OLMoE, DeepSeek-V2) or "sigmoid" (DeepSeek-V3,
      GLM-4.5); ``softmax_after_topk``: top-k of the logits, then a softmax over the k (GPT-OSS).
    - ``correction_bias``: a per-expert bias added to the scores for the *choice* only
      (``e_score_correction_bias``); the weights are the unbiased scores.
    - ``groups``/``topk_groups``: experts in ``groups`` equal groups, only the best
      ``topk_groups`` groups eligible, a group scored by its best expert ("max", DeepSeek-V2)
      or its best two summed ("top2", DeepSeek-V3).
    - ``renormalize``: the k weights divided by their sum; ``scale``: then multiplied by it.
    - ``float32``: the logits from float32 copies of x and the weight (DeepSeek).
    """

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        *,
        scoring: str = "softmax",
        softmax_after_topk: bool = False,
        renormalize: bool = False,
        scale: float = 1.0,
        bias: bool = False,
        correction_bias: bool = False,
        groups: int | None = None,
        topk_groups: int | None = None,
        group_score: str = "top2",
        float32: bool = False,
    ):
        super().__init__(hidden, num_experts, bias=bias)
        if scoring not in ("softmax", "sigmoid") or group_score not in ("top2", "max"):
            raise ValueError(f"unknown routing {scoring!r} / group score {group_score!r}")
        if groups is not None and (num_experts % groups or not 0 < (topk_groups or 0) <= groups):
            raise ValueError(
                f"{num_experts} experts cannot form {groups} groups, {topk_groups} kept"
            )
        self.num_experts, self.top_k = num_experts, top_k
        self.scoring, self.softmax_after_topk = scoring, softmax_after_topk
        self.renormalize, self.scale, self.float32 = renormalize, scale, float32
        self.groups, self.topk_groups, self.group_score = groups, topk_groups, group_score
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(num_experts)) if correction_bias else None
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.float32:
            bias = None if self.bias is None else self.bias.float()
            logits = F.linear(x.float(), self.weight.float(), bias)
        else:
            logits = super().forward(x)
        weights, ids = self.select(logits)
        return weights.to(x.dtype), ids

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, E) logits -> float32 weights (N, k), ids (N, k)."""
        if self.softmax_after_topk:
            top, ids = logits.topk(self.top_k, dim=-1)
            return torch.softmax(top.float(), dim=-1) * self.scale, ids
        if self.scoring == "softmax":
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        else:
            scores = logits.float().sigmoid()
        choice = scores
        if self.e_score_correction_bias is not None:
            choice = scores + self.e_score_correction_bias.float()
        if self.groups is not None:
            choice = self._eligible(choice)
        ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, ids

    def _eligible(self, choice: torch.Tensor) -> torch.Tensor:
        """``choice`` with the experts outside each token's best groups at -inf."""
        grouped = choice.view(choice.shape[0], self.groups, -1)
        if self.group_score == "max":
            group_scores = grouped.amax(dim=-1)
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        kept = group_scores.topk(self.topk_groups, dim=-1).indices
        mask = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, kept, False)
        return grouped.masked_fill(mask.unsqueeze(-1), float("-inf")).view_as(choice)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, top_k={self.top_k}, scoring={self.scoring}"


def gated(act: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``act(gate) * up`` over a (rows, 2I) gate/up output, gate first."""

    def act_and_mul(h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)
        return act(gate) * up

    return act_and_mul


def clamped_swiglu(alpha: float = 1.702, limit: float = 7.0):
    """GPT-OSS's expert activation: gate clamped above, up clamped both ways,
    ``(up + 1) * gate * sigmoid(alpha * gate)``."""

    def act_and_mul(h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    return act_and_mul


class ExpertsMethod:
    """How ``FusedExperts`` computes; subclasses override ``apply`` (and ``create_weights``
    when their weights are not the stacked dense tensors)."""

    def create_weights(self, layer: FusedExperts, bias: bool) -> None:
        e, h, i = layer.num_experts, layer.hidden, layer.intermediate
        layer.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        layer.down_proj = nn.Parameter(torch.empty(e, h, i))
        layer.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i)) if bias else None
        layer.down_proj_bias = nn.Parameter(torch.empty(e, h)) if bias else None

    def apply(self, layer: FusedExperts, x, weights, ids) -> torch.Tensor:
        raise NotImplementedError

    packable = True
    """Whether a compiled CPU step packs the stacked weights for oneDNN (``ExpertTable``)."""

    def loaded(self, layer: FusedExperts, leaf: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def join_pair(self, leaf: str, pair: list[torch.Tensor]) -> torch.Tensor:
        """One expert's gate and up checkpoint tensors -> its ``gate_up_proj`` part."""
        return torch.cat(pair)


class DenseExperts(ExpertsMethod):
    """Full precision: ``F.linear`` on slices of the stacked weights."""

    def apply(self, layer: FusedExperts, x, weights, ids) -> torch.Tensor:
        w13, b13, w2, b2 = (
            layer.gate_up_proj,
            layer.gate_up_proj_bias,
            layer.down_proj,
            layer.down_proj_bias,
        )

        def up(e: int, rows: torch.Tensor) -> torch.Tensor:
            return F.linear(rows, w13[e], None if b13 is None else b13[e])

        def down(e: int, rows: torch.Tensor) -> torch.Tensor:
            return F.linear(rows, w2[e], None if b2 is None else b2[e])

        return grouped_experts(x, weights, ids, layer.num_experts, up, down, layer.act_and_mul)


DENSE_EXPERTS = DenseExperts()


class OpExperts(ExpertsMethod):
    """Experts number ``slot`` of its decoder layer (whose number the ``FusedExperts``
    carries as the buffer ``step_index``), looked up in the bound step
    (``kernels.step_ops.fused_experts``): the compiled step's opaque expert op."""

    def __init__(self, slot: int):
        self.slot = slot

    def apply(self, layer: FusedExperts, x, weights, ids) -> torch.Tensor:
        return torch.ops.warmboot.fused_experts(x, weights, ids, layer.step_index, self.slot)


class FusedExperts(nn.Module):
    """A layer's ``num_experts`` gated MLPs as stacked weights: ``gate_up_proj`` (E, 2I, H),
    gate rows first, ``down_proj`` (E, H, I), optional biases. Checkpoints that store one
    tensor per expert are stacked by the loader (``shard_count``/``join_shards``)."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        act: str = "silu",
        bias: bool = False,
        act_and_mul: Callable[[torch.Tensor], torch.Tensor] | None = None,
        method: ExpertsMethod = DENSE_EXPERTS,
    ):
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.act_and_mul = act_and_mul or gated(activation(act))
        self.method = method
        method.create_weights(self, bias)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, weights, ids)

    # -- per-expert checkpoint tensors: shard ``expert * 2 + (0 gate | 1 up)``, or ``expert``
    def shard_count(self, leaf: str) -> int:
        return self.num_experts * (2 if leaf.startswith("gate_up_proj") else 1)

    def join_shards(self, leaf: str, parts: list[torch.Tensor]) -> torch.Tensor:
        if leaf.startswith("gate_up_proj"):
            pairs = range(0, len(parts), 2)
            parts = [self.method.join_pair(leaf, parts[e : e + 2]) for e in pairs]
        return torch.stack(parts)

    def extra_repr(self) -> str:
        bias = self.gate_up_proj_bias is not None
        return f"experts={self.num_experts}, {self.hidden} -> {self.intermediate}, bias={bias}"


class SparseMoE(nn.Module):
    """The MoE block that replaces a layer's MLP: routed experts, plus an optional shared
    expert (always run; scaled by ``sigmoid(shared_expert_gate(x))`` when given, Qwen2-MoE).
    ``zero_experts``: the router scores that many more ids than ``experts`` holds, identity
    experts that give a token back times its weight (LongCat-Flash's zero-compute experts)."""

    def __init__(
        self,
        gate: Router,
        experts: FusedExperts,
        shared_expert: nn.Module | None = None,
        shared_expert_gate: Linear | None = None,
        zero_experts: int = 0,
    ):
        super().__init__()
        if zero_experts and gate.num_experts != experts.num_experts + zero_experts:
            raise ValueError(
                f"a router of {gate.num_experts} ids over {experts.num_experts} experts"
                f" and {zero_experts} zero experts"
            )
        self.gate, self.experts = gate, experts
        self.shared_expert, self.shared_expert_gate = shared_expert, shared_expert_gate
        self.zero_experts = zero_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.zero_experts:
            zero = ids >= self.experts.num_experts
            out = out + x * torch.where(zero, weights, 0).sum(dim=-1, keepdim=True)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out
