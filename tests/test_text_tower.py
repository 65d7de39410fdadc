"""A multimodal release (Qwen3.5's ``...ForConditionalGeneration``, with a vision tower) served
as its language model (``architectures.TEXT_TOWERS``): its text config lifted, its language-model
tensors read under the text model's names, the vision tower's left unread. Built with
transformers itself; greedy tokens and logprobs as transformers' multimodal model gives for
text prompts (fp32), tied and untied heads, dense and MoE. A quantized release is still
refused by its top-level ``quantization_config``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers import random_prompts
from tests.test_families import LOGPROB_TOL, hf_greedy_logprobs
from tests.tiny_models import _COMMON, _SPECS, SEED, TOKENIZER_FILES, VOCAB_SIZE, _perturb
from tests.tiny_models import _tokenizer_dir as tokenizer_dir
from warmboot import LLM, SamplingParams
from warmboot.architectures import UnsupportedModelError
from warmboot.config import ModelConfig
from warmboot.models.checkpoint import check_servable

VISION = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=48,
    num_heads=2,
    out_hidden_size=48,
    num_position_embeddings=16,
    patch_size=4,
)
RELEASES = {
    "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration"),
    "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration"),
}


def _release(kind: str, tie: bool, out: Path):
    """A tiny random multimodal checkpoint whose text model is ``kind``'s family spec."""
    import transformers

    config_cls, model_cls = RELEASES[kind]
    text_cls, spec = _SPECS[kind]
    text = getattr(transformers, text_cls)(**(_COMMON | spec | {"tie_word_embeddings": tie}))
    config = getattr(transformers, config_cls)(
        text_config=text.to_dict(),
        vision_config=VISION,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(SEED)
    model = getattr(transformers, model_cls)(config)
    _perturb(model)
    model.eval().save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir(VOCAB_SIZE) / name, out / name)
    return model


def _text_twin(hf, kind: str, out) -> None:
    """The release's language model saved as a text-only checkpoint (its own class)."""
    import transformers

    text_cls = {"qwen3_5": "Qwen3_5ForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}[kind]
    twin = getattr(transformers, text_cls)(hf.config.text_config)
    state = {k.replace("model.language_model.", "model."): v for k, v in hf.state_dict().items()}
    twin.load_state_dict({k: v for k, v in state.items() if ".visual." not in k})
    twin.eval().save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir(VOCAB_SIZE) / name, out / name)


def _served(path, prompts) -> list[tuple[list[int], list[float]]]:
    llm = LLM(str(path), max_model_len=64, block_size=4, enforce_eager=True)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [
        (
            o.outputs[0].token_ids,
            [
                lp[t].logprob
                for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)
            ],
        )
        for o in outs
    ]


@pytest.mark.parametrize(("kind", "tie"), [("qwen3_5", True), ("qwen3_5_moe", False)])
def test_a_multimodal_release_serves_its_language_model(kind, tie, tmp_path):
    """Served exactly as the same weights saved as a text-only checkpoint (bit for bit), and
    with transformers' greedy tokens; logprobs within 1e-4 of transformers' for the dense
    release. (The MoE release's second prompt meets a routing near-tie, the 2nd and 3rd
    experts' probabilities 2.2e-5 apart, where fp32 rounding decides: 2.8e-4 from
    transformers, whose own fp32 is 1.2e-5 from its float64 there. The text-only MoE class is
    checked within 1e-4 in ``test_families``.)"""
    hf = _release(kind, tie, tmp_path / "release")
    saved = json.loads((tmp_path / "release" / "config.json").read_text())
    assert saved["architectures"] == [RELEASES[kind][1]] and "vision_config" in saved
    _text_twin(hf, kind, tmp_path / "text")
    prompts = random_prompts([21, 7], VOCAB_SIZE, seed=4)
    release = _served(tmp_path / "release", prompts)
    assert release == _served(tmp_path / "text", prompts), "as its text-only twin"
    for prompt, (tokens, lps) in zip(prompts, release, strict=True):
        want, want_lps = hf_greedy_logprobs(hf, prompt, 8)
        assert tokens == want
        if kind == "qwen3_5":
            assert max(abs(a - b) for a, b in zip(lps, want_lps, strict=True)) < LOGPROB_TOL
    llm_cfg = ModelConfig.from_dir(tmp_path / "release")
    assert llm_cfg.get("text_tower_of") == RELEASES[kind][1] and llm_cfg.tie_word_embeddings is tie


def test_a_quantized_release_is_refused_by_its_top_level_config():
    cfg = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": _COMMON | _SPECS["qwen3_5"][1] | {"model_type": "qwen3_5_text"},
        "vision_config": VISION,
        "quantization_config": {"quant_method": "bitsandbytes"},
    }
    with pytest.raises(UnsupportedModelError, match="quant_method 'bitsandbytes'"):
        check_servable(Path("/nonexistent"), ModelConfig.from_dict(cfg))
    with pytest.raises(UnsupportedModelError, match="without a text_config"):
        ModelConfig.from_dict({"architectures": ["Qwen3_5ForConditionalGeneration"]})


def test_models_says_a_release_is_served_text_only(tmp_path):
    """``/v1/models`` names the release whose language model is served; an image part is a
    400 naming the content part."""
    import httpx

    from tests.server_harness import MODEL_NAME, running_server, tiny_llm
    from warmboot.server.engine_holder import EngineHolder

    _release("qwen3_5", True, tmp_path / "release")
    llm = tiny_llm(tmp_path / "release", max_num_seqs=2, enforce_eager=True)
    with running_server(EngineHolder.ready(llm.engine)) as url:
        card = httpx.get(url + "/v1/models").json()["data"][0]
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": [image]}]}
        refused = httpx.post(url + "/v1/chat/completions", json=body)
    assert card["input_modalities"] == ["text"]
    assert card["served_text_only"].startswith("Qwen3_5ForConditionalGeneration")
    assert refused.status_code == 400 and "image" in refused.text, refused.text
