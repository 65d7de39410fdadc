"""Which architectures warmboot serves: a config's ``architectures`` (or, lacking them, its
``model_type``) -> a family module and class under ``warmboot.models`` (imported by
``models.registry``), multimodal releases read as their text tower. A torch-free leaf: the
configuration resolves a checkpoint, and refuses an unsupported one, before anything heavy is
imported."""

from __future__ import annotations

from typing import Any


class UnsupportedModelError(ValueError):
    """A checkpoint warmboot cannot serve exactly (architecture, setting, tensor, format):
    refused with the reason, never served approximately."""


ARCHITECTURES: dict[str, tuple[str, str]] = {
    # architecture: (module under warmboot.models, class)
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("llama", "Qwen3ForCausalLM"),
    "GraniteForCausalLM": ("granite", "GraniteForCausalLM"),
    "SmolLM3ForCausalLM": ("smollm3", "SmolLM3ForCausalLM"),
    # -- gemma.py --
    "GemmaForCausalLM": ("gemma", "GemmaForCausalLM"),
    "Gemma2ForCausalLM": ("gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma", "Gemma3ForCausalLM"),
    "Gemma3nForCausalLM": ("gemma3n", "Gemma3nForCausalLM"),
    "Gemma4ForCausalLM": ("gemma4", "Gemma4ForCausalLM"),
    # -- phi3.py, gpt_neox.py, starcoder2.py, glm4.py, phi.py, stablelm.py --
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "GPTNeoXForCausalLM": ("gpt_neox", "GPTNeoXForCausalLM"),
    "Starcoder2ForCausalLM": ("starcoder2", "Starcoder2ForCausalLM"),
    "Glm4ForCausalLM": ("glm4", "Glm4ForCausalLM"),
    "GlmForCausalLM": ("glm4", "GlmForCausalLM"),
    "PhiForCausalLM": ("phi", "PhiForCausalLM"),
    "StableLmForCausalLM": ("stablelm", "StableLmForCausalLM"),
    # -- olmo2.py, exaone4.py, cohere.py --
    "Olmo2ForCausalLM": ("olmo2", "Olmo2ForCausalLM"),
    "Olmo3ForCausalLM": ("olmo2", "Olmo3ForCausalLM"),
    "Exaone4ForCausalLM": ("exaone4", "Exaone4ForCausalLM"),
    "CohereForCausalLM": ("cohere", "CohereForCausalLM"),
    "Cohere2ForCausalLM": ("cohere", "Cohere2ForCausalLM"),
    "OlmoForCausalLM": ("olmo", "OlmoForCausalLM"),
    "ArceeForCausalLM": ("arcee", "ArceeForCausalLM"),
    "MinistralForCausalLM": ("ministral", "MinistralForCausalLM"),
    "Ernie4_5ForCausalLM": ("ernie4_5", "Ernie4_5ForCausalLM"),
    "SeedOssForCausalLM": ("seed_oss", "SeedOssForCausalLM"),
    "HunYuanDenseV1ForCausalLM": ("hunyuan_v1_dense", "HunYuanDenseV1ForCausalLM"),
    # -- ministral3.py, cwm.py, jais2.py, apertus.py, nanochat.py --
    "Ministral3ForCausalLM": ("ministral3", "Ministral3ForCausalLM"),
    "CwmForCausalLM": ("cwm", "CwmForCausalLM"),
    "Jais2ForCausalLM": ("jais2", "Jais2ForCausalLM"),
    "ApertusForCausalLM": ("apertus", "ApertusForCausalLM"),
    "NanoChatForCausalLM": ("nanochat", "NanoChatForCausalLM"),
    # -- mixtures of experts: mixtral.py, qwen_moe.py, olmoe.py, flex_olmo.py, granite.py --
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen_moe", "Qwen3MoeForCausalLM"),
    "OlmoeForCausalLM": ("olmoe", "OlmoeForCausalLM"),
    "FlexOlmoForCausalLM": ("flex_olmo", "FlexOlmoForCausalLM"),
    "GraniteMoeForCausalLM": ("granite", "GraniteMoeForCausalLM"),
    "GraniteMoeSharedForCausalLM": ("granite", "GraniteMoeSharedForCausalLM"),
    # -- multi-head latent attention: deepseek.py; V3's MoE over GQA: glm4_moe.py, dots1.py --
    "DeepseekV2ForCausalLM": ("deepseek", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek", "DeepseekV3ForCausalLM"),
    "Glm4MoeForCausalLM": ("glm4_moe", "Glm4MoeForCausalLM"),
    "Dots1ForCausalLM": ("dots1", "Dots1ForCausalLM"),
    # -- attention sinks + mixture of experts: gpt_oss.py --
    "GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM"),
    # -- more MoE: ernie4_5.py, hunyuan_v1_dense.py, phimoe.py, minimax_m2.py --
    "Ernie4_5_MoeForCausalLM": ("ernie4_5", "Ernie4_5_MoeForCausalLM"),
    "HunYuanMoEV1ForCausalLM": ("hunyuan_v1_dense", "HunYuanMoEV1ForCausalLM"),
    "PhimoeForCausalLM": ("phimoe", "PhimoeForCausalLM"),
    "MiniMaxM2ForCausalLM": ("minimax_m2", "MiniMaxM2ForCausalLM"),
    # -- hybrids: state layers beside attention (models/layers/state.py) --
    "Qwen3NextForCausalLM": ("qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5ForCausalLM": ("qwen3_next", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("qwen3_next", "Qwen3_5MoeForCausalLM"),
    "Lfm2ForCausalLM": ("lfm2", "Lfm2ForCausalLM"),
    "Lfm2MoeForCausalLM": ("lfm2", "Lfm2MoeForCausalLM"),
    "Lfm3ForCausalLM": ("lfm3", "Lfm3ForCausalLM"),
    "OlmoHybridForCausalLM": ("olmo_hybrid", "OlmoHybridForCausalLM"),
    "GraniteMoeHybridForCausalLM": ("granitemoehybrid", "GraniteMoeHybridForCausalLM"),
    "Mamba2ForCausalLM": ("mamba2", "Mamba2ForCausalLM"),
    "NemotronHForCausalLM": ("nemotron_h", "NemotronHForCausalLM"),
    "BambaForCausalLM": ("bamba", "BambaForCausalLM"),
    "FalconH1ForCausalLM": ("falcon_h1", "FalconH1ForCausalLM"),
    "Zamba2ForCausalLM": ("zamba2", "Zamba2ForCausalLM"),
    "JambaForCausalLM": ("jamba", "JambaForCausalLM"),
    "MambaForCausalLM": ("mamba", "MambaForCausalLM"),
    "FalconMambaForCausalLM": ("mamba", "FalconMambaForCausalLM"),
    "KimiLinearForCausalLM": ("kimi_linear", "KimiLinearForCausalLM"),
    "MiniMaxForCausalLM": ("minimax", "MiniMaxForCausalLM"),
    "BailingHybridForCausalLM": ("bailing_hybrid", "BailingHybridForCausalLM"),
    # -- issue 55, MoE variants: glm4_moe_lite.py, cohere2_moe.py, exaone_moe.py, afmoe.py,
    # granitemoe_swa.py, laguna.py, mimo_v2_flash.py --
    "Glm4MoeLiteForCausalLM": ("glm4_moe_lite", "Glm4MoeLiteForCausalLM"),
    "Cohere2MoeForCausalLM": ("cohere2_moe", "Cohere2MoeForCausalLM"),
    "ExaoneMoeForCausalLM": ("exaone_moe", "ExaoneMoeForCausalLM"),
    "AfmoeForCausalLM": ("afmoe", "AfmoeForCausalLM"),
    "GraniteMoeSWAForCausalLM": ("granitemoe_swa", "GraniteMoeSWAForCausalLM"),
    "LagunaForCausalLM": ("laguna", "LagunaForCausalLM"),
    "MiMoV2FlashForCausalLM": ("mimo_v2_flash", "MiMoV2FlashForCausalLM"),
    # -- end issue 55 block --
    # -- issue 55, variants of served families: hy_v3.py, youtu.py, mellum.py, solar_open.py,
    # granite_swa.py, hyperclovax.py, kolibri1.py --
    "HYV3ForCausalLM": ("hy_v3", "HYV3ForCausalLM"),
    "YoutuForCausalLM": ("youtu", "YoutuForCausalLM"),
    "MellumForCausalLM": ("mellum", "MellumForCausalLM"),
    "SolarOpenForCausalLM": ("solar_open", "SolarOpenForCausalLM"),
    "GraniteSWAForCausalLM": ("granite_swa", "GraniteSWAForCausalLM"),
    "HyperCLOVAXForCausalLM": ("hyperclovax", "HyperCLOVAXForCausalLM"),
    "Kolibri1ForCausalLM": ("kolibri1", "Kolibri1ForCausalLM"),
    # -- end issue 55 variants block --
    # -- issue 55, more variants: axk1.py, flint.py, beam.py --
    "AXK1ForCausalLM": ("axk1", "AXK1ForCausalLM"),
    "BeamForCausalLM": ("beam", "BeamForCausalLM"),
    "FlintForCausalLM": ("flint", "FlintForCausalLM"),
    # -- end issue 55 more variants block --
    # -- issue 55, two attention sublayers a layer: longcat_flash.py --
    "LongcatFlashForCausalLM": ("longcat_flash", "LongcatFlashForCausalLM"),
    # -- end issue 55 longcat block --
    # -- issue 55, weight-tied recurrent stacks: hrm_text.py --
    "HrmTextForCausalLM": ("hrm_text", "HrmTextForCausalLM"),
    # -- end issue 55 hrm block --
    # -- issue 55, chunked local attention: llama4.py --
    "Llama4ForCausalLM": ("llama4", "Llama4ForCausalLM"),
    # -- end issue 55 llama4 block --
    # -- issue 55, sparse indexed attention: deepseek_v32.py --
    "DeepseekV32ForCausalLM": ("deepseek_v32", "DeepseekV32ForCausalLM"),
    "GlmMoeDsaForCausalLM": ("deepseek_v32", "GlmMoeDsaForCausalLM"),
    "MiniMaxM3VLForCausalLM": ("minimax_m3", "MiniMaxM3VLForCausalLM"),
    # -- issue 55, sparse indexed attention variants: axk2.py, hy_v4.py, dots3_note.py --
    "AXK2ForCausalLM": ("axk2", "AXK2ForCausalLM"),
    "HYV4ForCausalLM": ("hy_v4", "HYV4ForCausalLM"),
    "Dots3NoteForCausalLM": ("dots3_note", "Dots3NoteForCausalLM"),
    # -- end issue 55 sparse variants block --
    # -- issue 55, compressed K/V streams: deepseek_v4.py --
    "DeepseekV4ForCausalLM": ("deepseek_v4", "DeepseekV4ForCausalLM"),
    # -- end issue 55 deepseek_v4 block --
}
"""Every architecture served; a test checks each against transformers."""

MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    # -- gemma.py --
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3n_text": "Gemma3nForCausalLM",
    "gemma4_text": "Gemma4ForCausalLM",
    # -- phi3.py, gpt_neox.py, starcoder2.py, glm4.py, phi.py, stablelm.py --
    "phi3": "Phi3ForCausalLM",
    "gpt_neox": "GPTNeoXForCausalLM",
    "starcoder2": "Starcoder2ForCausalLM",
    "glm4": "Glm4ForCausalLM",
    "glm": "GlmForCausalLM",
    "phi": "PhiForCausalLM",
    "stablelm": "StableLmForCausalLM",
    # -- olmo2.py, exaone4.py, cohere.py --
    "olmo2": "Olmo2ForCausalLM",
    "olmo3": "Olmo3ForCausalLM",
    "exaone4": "Exaone4ForCausalLM",
    "cohere": "CohereForCausalLM",
    "cohere2": "Cohere2ForCausalLM",
    "olmo": "OlmoForCausalLM",
    "arcee": "ArceeForCausalLM",
    "ministral": "MinistralForCausalLM",
    "ernie4_5": "Ernie4_5ForCausalLM",
    "seed_oss": "SeedOssForCausalLM",
    "hunyuan_v1_dense": "HunYuanDenseV1ForCausalLM",
    "ministral3": "Ministral3ForCausalLM",
    "cwm": "CwmForCausalLM",
    "jais2": "Jais2ForCausalLM",
    "apertus": "ApertusForCausalLM",
    "nanochat": "NanoChatForCausalLM",
    # -- mixtures of experts --
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "flex_olmo": "FlexOlmoForCausalLM",
    "granitemoe": "GraniteMoeForCausalLM",
    "granitemoeshared": "GraniteMoeSharedForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "dots1": "Dots1ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "ernie4_5_moe": "Ernie4_5_MoeForCausalLM",
    "hunyuan_v1_moe": "HunYuanMoEV1ForCausalLM",
    "phimoe": "PhimoeForCausalLM",
    "minimax_m2": "MiniMaxM2ForCausalLM",
    # -- hybrids --
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "lfm2": "Lfm2ForCausalLM",
    "lfm2_moe": "Lfm2MoeForCausalLM",
    "lfm3": "Lfm3ForCausalLM",
    "olmo_hybrid": "OlmoHybridForCausalLM",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
    "mamba2": "Mamba2ForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
    "bamba": "BambaForCausalLM",
    "falcon_h1": "FalconH1ForCausalLM",
    "zamba2": "Zamba2ForCausalLM",
    "jamba": "JambaForCausalLM",
    "mamba": "MambaForCausalLM",
    "falcon_mamba": "FalconMambaForCausalLM",
    "kimi_linear": "KimiLinearForCausalLM",
    "minimax": "MiniMaxForCausalLM",
    "bailing_hybrid": "BailingHybridForCausalLM",
    # -- issue 55, MoE variants --
    "deepseek_v32": "DeepseekV32ForCausalLM",
    "glm_moe_dsa": "GlmMoeDsaForCausalLM",
    "minimax_m3_vl_text": "MiniMaxM3VLForCausalLM",
    "glm4_moe_lite": "Glm4MoeLiteForCausalLM",
    "cohere2_moe": "Cohere2MoeForCausalLM",
    "exaone_moe": "ExaoneMoeForCausalLM",
    "afmoe": "AfmoeForCausalLM",
    "granitemoe_swa": "GraniteMoeSWAForCausalLM",
    "laguna": "LagunaForCausalLM",
    "mimo_v2_flash": "MiMoV2FlashForCausalLM",
    # -- end issue 55 block --
    # -- issue 55, variants of served families --
    "hy_v3": "HYV3ForCausalLM",
    "youtu": "YoutuForCausalLM",
    "mellum": "MellumForCausalLM",
    "solar_open": "SolarOpenForCausalLM",
    "granite_swa": "GraniteSWAForCausalLM",
    "hyperclovax": "HyperCLOVAXForCausalLM",
    "kolibri1": "Kolibri1ForCausalLM",
    # -- end issue 55 variants block --
    # -- issue 55, more variants --
    "axk1": "AXK1ForCausalLM",
    "beam": "BeamForCausalLM",
    "flint": "FlintForCausalLM",
    # -- end issue 55 more variants block --
    # -- issue 55, longcat --
    "longcat_flash": "LongcatFlashForCausalLM",
    # -- end issue 55 longcat block --
    # -- issue 55, hrm --
    "hrm_text": "HrmTextForCausalLM",
    # -- end issue 55 hrm block --
    # -- issue 55, chunked local attention --
    "llama4_text": "Llama4ForCausalLM",
    # -- end issue 55 llama4 block --
    # -- issue 55, sparse indexed attention variants --
    "axk2": "AXK2ForCausalLM",
    "hy_v4": "HYV4ForCausalLM",
    "dots3_note_text": "Dots3NoteForCausalLM",
    # -- end issue 55 sparse variants block --
    # -- issue 55, compressed K/V streams --
    "deepseek_v4": "DeepseekV4ForCausalLM",
    # -- end issue 55 deepseek_v4 block --
}
"""``model_type`` -> architecture, for configs without ``architectures``."""


TEXT_TOWERS: dict[str, dict[str, str]] = {
    # a multimodal checkpoint's architecture: its text_config's model_type -> the text tower's
    # architecture (the first: transformers' default where the text_config names none)
    "Qwen3_5ForConditionalGeneration": {"qwen3_5_text": "Qwen3_5ForCausalLM"},
    "Qwen3_5MoeForConditionalGeneration": {"qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"},
    "Gemma3ForConditionalGeneration": {"gemma3_text": "Gemma3ForCausalLM"},
    "Gemma3nForConditionalGeneration": {"gemma3n_text": "Gemma3nForCausalLM"},
    "Gemma4ForConditionalGeneration": {"gemma4_text": "Gemma4ForCausalLM"},
    "Mistral3ForConditionalGeneration": {
        "mistral": "MistralForCausalLM",
        "ministral3": "Ministral3ForCausalLM",
    },
    "MiniMaxM3SparseForConditionalGeneration": {"minimax_m3_vl_text": "MiniMaxM3VLForCausalLM"},
    "Llama4ForConditionalGeneration": {"llama4_text": "Llama4ForCausalLM"},
}
"""Multimodal checkpoints served as their language model: text in, text out (a request with
an image is refused by the API, never served without it). ``text_tower`` reads the config,
``models.base.TOWER_RENAMES`` the tensors; the vision and audio towers' are ignored."""
TOWER_KEY = "text_tower_of"
"""Set in a text tower's config: the multimodal architecture it came from."""
TOWER_PARTS = "text_tower_parts"
"""Set in a text tower's config: the multimodal config's settings its family reads
(``_TOWER_PARTS``: Gemma 3n's multimodal vocabularies, Gemma 4's placeholder ids)."""
_TOP_LEVEL = ("eos_token_id", "bos_token_id", "pad_token_id", "quantization_config")
_TOWER_TIES: dict[str, bool | str] = {
    # its tied head: the top-level tie_word_embeddings (this default where config.json omits
    # it); "text": the text config's (the language model keeps its own head); "either": tied
    # where either config says so (MiniMax-M3's config)
    "Qwen3_5ForConditionalGeneration": False,
    "Qwen3_5MoeForConditionalGeneration": False,
    "Gemma3ForConditionalGeneration": True,
    "Gemma3nForConditionalGeneration": True,
    "Gemma4ForConditionalGeneration": True,
    "Mistral3ForConditionalGeneration": True,
    "MiniMaxM3SparseForConditionalGeneration": "either",
    "Llama4ForConditionalGeneration": "text",
}
_TOWER_SETTINGS: dict[str, dict[str, Any]] = {
    # NOTE: Gemma 3's multimodal head applies no final soft-cap (its text config's is unread)
    "Gemma3ForConditionalGeneration": {"final_logit_softcapping": None},
}
_TOWER_PARTS: dict[str, tuple[str, ...]] = {
    "Gemma3nForConditionalGeneration": ("vision_config", "audio_config"),
    "Gemma4ForConditionalGeneration": ("image_token_id", "video_token_id", "audio_token_id"),
}
_TEXT_DEFAULTS: dict[str, dict[str, Any]] = {
    # NOTE: Gemma 3's releases write a short text_config: transformers' Gemma3TextConfig
    # shape for what it leaves out (the family's code knows the other defaults)
    "Gemma3ForConditionalGeneration": {
        "vocab_size": 262_208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "max_position_embeddings": 131_072,
    },
}


def text_tower(cfg: dict[str, Any]) -> dict[str, Any]:
    """A multimodal checkpoint's config (``TEXT_TOWERS``) as its text tower's: the
    ``text_config`` (of a model_type served) with the fields a multimodal config keeps at the
    top level (the special tokens, a quantization) taken from there, the release's tie rule
    and own settings applied; any other config as it is."""
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in TEXT_TOWERS), None) if isinstance(archs, list) else None
    if arch is None:
        return cfg
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise UnsupportedModelError(f"{arch} config without a text_config object")
    towers = TEXT_TOWERS[arch]
    kind = text.get("model_type") or next(iter(towers))
    if kind not in towers:
        raise UnsupportedModelError(
            f"{arch} with a {kind!r} text_config; served: {', '.join(towers)}"
        )
    top = {k: cfg[k] for k in _TOP_LEVEL if cfg.get(k) is not None}
    text = _TEXT_DEFAULTS.get(arch, {}) | text | top
    text |= {"tie_word_embeddings": _tied(arch, cfg, text)} | _TOWER_SETTINGS.get(arch, {})
    dtype = text.get("dtype") or cfg.get("dtype") or cfg.get("torch_dtype")
    parts = {k: cfg[k] for k in _TOWER_PARTS.get(arch, ()) if cfg.get(k) is not None}
    tower = {"architectures": [towers[kind]], TOWER_KEY: arch, TOWER_PARTS: parts}
    return text | tower | {"dtype": dtype}


def _tied(arch: str, cfg: dict[str, Any], text: dict[str, Any]) -> bool | None:
    """Whether the multimodal model ties its head (``_TOWER_TIES``); None: the family's
    default (a text config that does not say)."""
    rule, top = _TOWER_TIES.get(arch, False), cfg.get("tie_word_embeddings")
    if rule == "text":
        return text.get("tie_word_embeddings")
    if rule == "either":
        return bool(top) or bool(text.get("tie_word_embeddings"))
    return rule if top is None else bool(top)


def resolve_architecture(cfg: dict[str, Any]) -> str:
    """The served architecture a config names, or ``UnsupportedModelError`` naming it."""
    archs = cfg.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    for arch in archs:
        if arch in ARCHITECTURES:
            return arch
    if not archs and cfg.get("model_type") in MODEL_TYPES:
        return MODEL_TYPES[cfg["model_type"]]
    named = archs or f"model_type {cfg.get('model_type')!r}"
    raise UnsupportedModelError(
        f"unsupported architecture {named}; warmboot serves {', '.join(sorted(ARCHITECTURES))}"
    )
