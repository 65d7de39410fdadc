"""The 2026 multimodal releases (``...ForConditionalGeneration``) served as their language
model (``architectures.TEXT_TOWERS``): Gemma 3, Gemma 3n (vision and audio), Gemma 4 (vision and
audio), Mistral 3 (a Ministral 3 or a Mistral text config), MiniMax-M3 and Llama 4. Each is
built with transformers itself around a family's tiny text spec with tiny towers, saved, and
reloaded by transformers as the reference: greedy tokens and logprobs (fp32) as its multimodal
model gives for text prompts; the towers' tensors are in the checkpoint and not read, while
an unknown tensor of the language model is still refused. Also checked: Gemma 3's multimodal
head has no final soft-cap (its text config's is unread), Gemma 3n's vision and audio ids read
their towers' embedders, Gemma 4's placeholder ids read the pad token, and each release's
own tie rule (a default where config.json omits it; MiniMax-M3 ties where either config
does; Llama 4's text config decides)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import random_prompts
from tests.test_families import LOGPROB_TOL, hf_greedy_logprobs
from tests.test_text_tower import _served
from tests.tiny_models import _COMMON, _SPECS, SEED, TOKENIZER_FILES, VOCAB_SIZE, _perturb
from tests.tiny_models import _tokenizer_dir as tokenizer_dir
from warmboot import LLM
from warmboot.architectures import UnsupportedModelError
from warmboot.config import ModelConfig

SIGLIP = dict(
    model_type="siglip_vision_model",
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=8,
    patch_size=4,
)
PIXTRAL = dict(
    model_type="pixtral",
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=1,
    num_attention_heads=2,
    head_dim=8,
    image_size=16,
    patch_size=4,
)
GEMMA4_TOWERS = dict(
    vision_config=dict(
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        patch_size=4,
        pooling_kernel_size=2,
        position_embedding_size=64,
    ),
    audio_config=dict(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        subsampling_conv_channels=[4, 4],
        output_proj_dims=16,
    ),
    image_token_id=500,
    video_token_id=507,
    audio_token_id=509,
)
GEMMA3N_TOWERS = dict(
    vision_config=dict(hidden_size=24, vocab_offset=480, vocab_size=16),
    audio_config=dict(
        hidden_size=16,
        vocab_offset=496,
        vocab_size=16,
        conf_num_hidden_layers=1,
        conf_num_attention_heads=2,
        input_feat_size=8,
        sscp_conv_channel_size=[4, 4],
    ),
    image_token_id=481,
    audio_token_id=497,
)
LLAMA4_VISION = dict(
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=1,
    num_attention_heads=2,
    vision_output_dim=16,
    image_size=8,
    patch_size=4,
    projector_input_dim=16,
    projector_output_dim=16,
)
MINIMAX_VISION = dict(
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=1,
    num_attention_heads=2,
    patch_size=4,
    image_size=16,
)


def _drop_tie(saved: dict) -> None:
    saved.pop("tie_word_embeddings")


def _untie_top(saved: dict) -> None:
    saved["tie_word_embeddings"] = False


@dataclasses.dataclass(frozen=True)
class Release:
    config: str
    model: str
    text: str  # NOTE: the family spec (``tests/family_specs``) of its language model
    towers: dict
    text_changes: dict = dataclasses.field(default_factory=dict)
    edit: Callable[[dict], None] | None = None  # NOTE: config.json as saved, edited
    tied: bool = False  # NOTE: the tie transformers makes of the edited config.json
    prompt: tuple[int, ...] = ()  # NOTE: ids a tower reads (Gemma 3n, Gemma 4)


RELEASES = {
    "gemma3": Release(
        "Gemma3Config",
        "Gemma3ForConditionalGeneration",
        "gemma3_local_rope",  # NOTE: its final_logit_softcapping 8.0 is not applied
        dict(vision_config=SIGLIP, mm_tokens_per_image=4, image_token_index=500),
        tied=True,
    ),
    "gemma3n": Release(
        "Gemma3nConfig",
        "Gemma3nForConditionalGeneration",
        "gemma3n_shared_kv",
        GEMMA3N_TOWERS,
        tied=True,
        prompt=(5, 481, 90, 482, 495, 496, 3, 511, 500, 7, 481),
    ),
    "gemma4": Release(
        "Gemma4Config",
        "Gemma4ForConditionalGeneration",
        "gemma4",
        GEMMA4_TOWERS,
        tied=True,
        prompt=(5, 500, 500, 90, 507, 3, 509, 12, 0, 511),
    ),
    "ministral3": Release(
        "Mistral3Config",
        "Mistral3ForConditionalGeneration",
        "ministral3",
        dict(vision_config=PIXTRAL, image_token_index=500, tie_word_embeddings=False),
    ),
    "mistral3_mistral": Release(  # NOTE: Mistral Small 3's text config; a tie by default
        "Mistral3Config",
        "Mistral3ForConditionalGeneration",
        "mistral",
        dict(vision_config=PIXTRAL, image_token_index=500, tie_word_embeddings=True),
        text_changes=dict(tie_word_embeddings=False),
        edit=_drop_tie,
        tied=True,
    ),
    "minimax_m3": Release(  # NOTE: tied by its text config alone
        "MiniMaxM3VLConfig",
        "MiniMaxM3SparseForConditionalGeneration",
        "minimax_m3",
        dict(vision_config=MINIMAX_VISION, projector_hidden_size=16, image_token_index=500),
        text_changes=dict(tie_word_embeddings=True),
        edit=_untie_top,
        tied=True,
    ),
    "llama4": Release(  # NOTE: the top-level tie is not Llama 4's (its text config's is)
        "Llama4Config",
        "Llama4ForConditionalGeneration",
        "llama4_text",
        dict(vision_config=LLAMA4_VISION, image_token_index=500, tie_word_embeddings=True),
    ),
}


@contextlib.contextmanager
def _gemma3n_vision_stub():
    """Gemma 3n's vision tower is a timm model (not installed): a stub with a tensor of its
    own stands in; text prompts never reach it."""
    import transformers
    from transformers.models.gemma3n import modeling_gemma3n

    class Stub(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv_stem = torch.nn.Linear(4, 4)

    class Auto:
        @staticmethod
        def from_config(config, **kwargs):
            if type(config).__name__ == "Gemma3nVisionConfig":
                return Stub()
            return transformers.AutoModel.from_config(config, **kwargs)

    saved = modeling_gemma3n.AutoModel
    modeling_gemma3n.AutoModel = Auto
    try:
        yield
    finally:
        modeling_gemma3n.AutoModel = saved


def _release(kind: str, out: Path):
    """The tiny release saved in ``out`` and transformers' model reloaded from it (fp32)."""
    import transformers

    r = RELEASES[kind]
    text_cls, spec = _SPECS[r.text]
    text = getattr(transformers, text_cls)(**(_COMMON | spec | r.text_changes))
    config = getattr(transformers, r.config)(text_config=text.to_dict(), **r.towers)
    model_cls = getattr(transformers, r.model)
    with _gemma3n_vision_stub():
        torch.manual_seed(SEED)
        model = model_cls(config)
        _perturb(model)
        model.eval().save_pretrained(out)
        if r.edit is not None:
            saved = json.loads((out / "config.json").read_text())
            r.edit(saved)
            (out / "config.json").write_text(json.dumps(saved))
        hf = model_cls.from_pretrained(out, dtype=torch.float32).eval()
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir(VOCAB_SIZE) / name, out / name)
    return hf


def _heads_tied(hf) -> bool:
    return hf.get_output_embeddings().weight is hf.get_input_embeddings().weight


TOWER_PREFIXES = (
    "model.vision_tower.",
    "model.audio_tower.",
    "model.embed_vision.",
    "model.multi_modal_projector.",
    "vision_model.",
    "multi_modal_projector.",
)


@pytest.mark.parametrize("kind", list(RELEASES))
def test_a_release_serves_its_language_model(kind, tmp_path):
    """Greedy tokens and logprobs as transformers' multimodal model's for text prompts; its
    towers' tensors left unread; an unknown language-model tensor refused."""
    r, path = RELEASES[kind], tmp_path / "release"
    hf = _release(kind, path)
    assert _heads_tied(hf) is r.tied, "the tie rule transformers applies"
    saved = json.loads((path / "config.json").read_text())
    assert saved["architectures"] == [r.model]
    cfg = ModelConfig.from_dir(path)
    assert cfg.get("text_tower_of") == r.model
    assert cfg.tie_word_embeddings is r.tied, "the release's tie rule"
    prompts = random_prompts([23, 6], VOCAB_SIZE, seed=7) + ([list(r.prompt)] if r.prompt else [])
    served = _served(path, prompts)
    with torch.no_grad():
        for prompt, (tokens, lps) in zip(prompts, served, strict=True):
            want, want_lps = hf_greedy_logprobs(hf, prompt, 8)
            assert tokens == want, (prompt, tokens, want)
            assert max(abs(a - b) for a, b in zip(lps, want_lps, strict=True)) < LOGPROB_TOL
    weights = load_file(path / "model.safetensors")
    assert any(name.startswith(TOWER_PREFIXES) for name in weights), "towers in the checkpoint"
    lm = "language_model.model." if kind == "llama4" else "model.language_model."
    weights[lm + "layers.0.mlp.extra_proj.weight"] = torch.zeros(4, 4)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match="does not read.*extra_proj"):
        LLM(str(path), max_model_len=64, block_size=4, enforce_eager=True)


def test_a_release_with_an_unserved_text_config_is_refused():
    cfg = {
        "architectures": ["Mistral3ForConditionalGeneration"],
        "text_config": _COMMON | _SPECS["llama"][1] | {"model_type": "llama"},
    }
    with pytest.raises(UnsupportedModelError, match="'llama' text_config; served: mistral"):
        ModelConfig.from_dict(cfg)
    cfg = {"architectures": ["Gemma3nForConditionalGeneration"], "text_config": cfg["text_config"]}
    with pytest.raises(UnsupportedModelError, match="gemma3n_text"):
        ModelConfig.from_dict(cfg)


def test_a_gemma3_release_short_text_config_takes_transformers_defaults():
    """Gemma 3's releases write a short ``text_config`` (this is the 4B's): the shape as
    transformers' ``Gemma3TextConfig`` fills it in; the top-level end tokens; tied."""
    import transformers

    text = dict(
        hidden_size=2560,
        intermediate_size=10240,
        model_type="gemma3_text",
        num_hidden_layers=34,
        rope_scaling={"factor": 8.0, "rope_type": "linear"},
        sliding_window=1024,
    )
    release = {"architectures": [RELEASES["gemma3"].model], "text_config": text}
    ours = ModelConfig.from_dict(release | {"eos_token_id": [1, 106]})
    theirs = transformers.Gemma3Config(text_config=text).text_config
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
    keys += ("num_key_value_heads", "head_dim", "max_position_embeddings", "intermediate_size")
    assert {k: ours.hf[k] for k in keys} == {k: getattr(theirs, k) for k in keys}
    assert (ours.num_heads, ours.num_kv_heads, ours.head_dim) == (8, 4, 256)
    assert ours.tie_word_embeddings and ours.eos_token_ids == (1, 106)


def test_the_api_serves_gemma3n_text_only(tmp_path):
    """``/v1/models`` names the release; an image part and an audio part are each a 400."""
    import httpx

    from tests.server_harness import MODEL_NAME, running_server, tiny_llm
    from warmboot.server.engine_holder import EngineHolder

    _release("gemma3n", tmp_path / "release")
    llm = tiny_llm(tmp_path / "release", max_num_seqs=2, enforce_eager=True)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    with running_server(EngineHolder.ready(llm.engine)) as url:
        card = httpx.get(url + "/v1/models").json()["data"][0]
        refused = [
            httpx.post(
                url + "/v1/chat/completions",
                json={"model": MODEL_NAME, "messages": [{"role": "user", "content": [part]}]},
            )
            for part in (image, audio)
        ]
    assert card["served_text_only"].startswith("Gemma3nForConditionalGeneration")
    for response, kind in zip(refused, ("image_url", "input_audio"), strict=True):
        assert response.status_code == 400 and kind in response.text, response.text
