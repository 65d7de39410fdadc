"""SmolLM3 (Hugging Face): Llama whose ``no_rope_layers`` (0 entries) attend without
rotary embeddings (NoPE), optionally windowed."""

from __future__ import annotations

from warmboot.models.layers.attention import Attention
from warmboot.models.llama import LlamaForCausalLM


class SmolLM3ForCausalLM(LlamaForCausalLM):
    def attention(self, index: int, **kwargs) -> Attention:
        uses_rope = self.cfg.get("no_rope_layers", [1] * self.cfg.num_layers)[index]
        return super().attention(index, **kwargs | ({} if uses_rope else {"rope": None}))

    def sliding_window(self, index: int) -> int | None:
        if not self.cfg.get("use_sliding_window", False):
            return None
        return super().sliding_window(index)
