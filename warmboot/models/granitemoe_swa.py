"""Granite-MoE SWA (``GraniteMoeSWAForCausalLM``): Granite SWA's attention (a learned sink
per head, windows on the ``sliding_attention`` layers, a rope base per layer, 0 for NoPE)
over Granite-MoE-Shared's blocks (top-k of the router logits then a softmax over the k,
fused experts, an optional dense shared MLP). Its experts and router are read under
Granite-MoE's names or transformers 5's (``block_sparse_moe.experts.gate_up_proj``,
``block_sparse_moe.router.weight``)."""

from __future__ import annotations

from warmboot.models.granite import GraniteMoeForCausalLM
from warmboot.models.granite_swa import GraniteSWAForCausalLM


class GraniteMoeSWAForCausalLM(GraniteSWAForCausalLM):
    renames = GraniteMoeForCausalLM.renames + (
        (r"\.block_sparse_moe\.experts\.", ".mlp.experts."),
        (r"\.block_sparse_moe\.router\.", ".mlp.gate."),
    )
    make_mlp = GraniteMoeForCausalLM.make_mlp
