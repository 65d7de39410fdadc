"""The grouped expert step: a mixture-of-experts layer's routed tokens through their experts'
GEMM pairs, one pair per expert that has tokens (``models.layers.moe``' experts, eager and
quantized, and ``kernels.step_ops``' packed ``ExpertTable``: each brings its own GEMMs)."""

from __future__ import annotations

from collections.abc import Callable

import torch

ExpertGemm = Callable[[int, torch.Tensor], torch.Tensor]
"""(expert, rows) -> rows times that expert's gate/up or down projection (bias included)."""


def grouped_experts(
    x: torch.Tensor,  # (N, H)
    weights: torch.Tensor,  # (N, k)
    ids: torch.Tensor,  # (N, k)
    num_experts: int,
    up: ExpertGemm,
    down: ExpertGemm,
    act_and_mul: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:  # (N, H)
    """Sum over each token's k experts of ``weight * down(act(up(x)))``: the (token, expert)
    pairs sorted by expert once, one GEMM pair per expert that has tokens, one activation
    over all rows. One token (decode at batch 1) needs no sort: its k experts in turn.
    Ids at or past ``num_experts`` (``SparseMoE``'s zero experts) are skipped."""
    n, k = ids.shape
    if n == 1:
        picks = [(j, e) for j, e in enumerate(ids[0].tolist()) if e < num_experts]
        if not picks:
            return torch.zeros_like(x)
        hidden = act_and_mul(torch.cat([up(e, x) for _, e in picks]))  # (k, I)
        out = torch.cat([down(e, hidden[i : i + 1]) for i, (_, e) in enumerate(picks)])
        if len(picks) < k:
            weights = weights[:, [j for j, _ in picks]]
        return weights @ out  # (1, k) @ (k, H)
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()[:num_experts]
    spans = [(e, c) for e, c in enumerate(counts) if c]
    if not spans:
        return torch.zeros_like(x)
    order = order[: sum(c for _, c in spans)]  # NOTE: skipped ids sort last
    token = order // k
    rows = x.index_select(0, token).split([c for _, c in spans])
    hidden = act_and_mul(torch.cat([up(e, r) for (e, _), r in zip(spans, rows, strict=True)]))
    parts = hidden.split([c for _, c in spans])
    out = torch.cat([down(e, h) for (e, _), h in zip(spans, parts, strict=True)])
    out *= weights.flatten().index_select(0, order).unsqueeze(1)
    return torch.zeros_like(x).index_add_(0, token, out)
