"""Seed-OSS: Llama with q/k/v biases (``attention_bias``, on by default) and a separate
``attention_out_bias`` for o_proj."""

from __future__ import annotations

from warmboot.models.llama import LlamaForCausalLM


class SeedOssForCausalLM(LlamaForCausalLM):
    def attention_options(self) -> dict:
        cfg = self.cfg
        return dict(
            qkv_bias=bool(cfg.hf.get("attention_bias", True)),
            o_bias=bool(cfg.get("attention_out_bias", False)),
        )
