"""LoRA adapters end to end against peft's unmerged ``PeftModel`` (fp32): greedy tokens
identical and logprobs within 1e-3, for one adapter, for a batch mixing two adapters and the
base, with rsLoRA and bf16 adapter weights, through chunked prefill, preemption and prefix
sharing (a prefix shared under two adapters is two cache entries), compiled and eager; and
the refusals, each naming what is wrong, after which the engine keeps serving."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_engine_clean, random_prompts
from tests.lora_adapters import import_peft, make_adapter, peft_missing
from tests.tiny_models import make_tiny_model
from warmboot import LLM, LoRARequest, SamplingParams
from warmboot.core.errors import InvalidRequestError

pytestmark = pytest.mark.skipif(peft_missing() is not None, reason=str(peft_missing()))

MAX_NEW = 8
TOL = 1e-3
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MODES = {
    "eager-sync": dict(enforce_eager=True, pipelined=False),
    "compiled-pipelined": dict(
        enforce_eager=False, compile_steps=True, pipelined=True, wait_for_compile=True
    ),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny Llama, two adapters (all linears r=8; q/v r=4 rsLoRA saved in bf16) and peft's
    greedy tokens and logprobs for each adapter and the base."""
    root = tmp_path_factory.mktemp("lora")
    model = make_tiny_model("llama", root / "model")
    adapters = {
        "full": make_adapter(
            root / "full", model, r=8, alpha=16, target_modules=ALL_LINEAR, std=0.5
        ),
        "qv": make_adapter(
            root / "qv", model, r=4, alpha=8, rslora=True, dtype="bfloat16", seed=1, std=0.5
        ),
    }
    shared = random_prompts([24], 500, seed=3)[0]
    prompts = random_prompts([5, 19, 37], 500, seed=1) + [shared + [7, 8], shared + [9]]
    refs = {name: _reference(model, path, prompts) for name, path in adapters.items()}
    refs[None] = _reference(model, None, prompts)
    assert refs["full"][0] != refs[None][0] and refs["qv"][0] != refs[None][0], "adapters idle"
    return model, adapters, prompts, refs


@torch.no_grad()
def _reference(model_dir, adapter, prompts):
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        base = import_peft().PeftModel.from_pretrained(base, str(adapter))
    base.eval()
    tokens, lps = [], []
    for p in prompts:
        seq = list(p)
        got, logprob = [], []
        for _ in range(MAX_NEW):
            logits = base(torch.tensor([seq])).logits[0, -1].float()
            t = int(logits.argmax())
            got.append(t)
            logprob.append(float(torch.log_softmax(logits, -1)[t]))
            seq.append(t)
        tokens.append(got)
        lps.append(logprob)
    return tokens, lps


def _llm(model, max_loras: int = 2, **kw):
    return LLM(
        str(model),
        max_model_len=96,
        block_size=4,
        num_kv_blocks=24,  # NOTE: cannot hold every sequence: preemption
        max_num_batched_tokens=16,  # NOTE: chunked prefill
        max_num_seqs=4,
        enable_lora=True,
        max_loras=max_loras,
        **kw,
    )


def _check(outs, refs, which: list, prompts) -> None:
    for i, (out, name) in enumerate(zip(outs, which, strict=True)):
        want_tokens, want_lps = refs[name][0][i], refs[name][1][i]
        got = out.outputs[0]
        assert got.token_ids == want_tokens, f"prompt {i} ({name}) differs"
        lps = [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids, strict=True)]
        err = max(abs(a - b) for a, b in zip(lps, want_lps, strict=True))
        assert err < TOL, f"prompt {i} ({name}) logprob error {err:.2e}"


@pytest.mark.parametrize("mode", list(MODES))
def test_mixed_batch_matches_peft(setup, mode):
    model, adapters, prompts, refs = setup
    llm = _llm(model, **MODES[mode])
    reqs = {n: LoRARequest(n, i + 1, str(p)) for i, (n, p) in enumerate(adapters.items())}
    which = ["full", "qv", None, "full", "qv"]  # NOTE: the shared prefix under two adapters
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    lora = [None if n is None else reqs[n] for n in which]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=lora)
    _check(outs, refs, which, prompts)
    stats = llm.stats()
    assert stats["preemptions"] > 0
    assert stats["compile"]["compiled"] is (mode == "compiled-pipelined")
    # a second round: every prompt under each adapter again; hits stay within an adapter
    for name in ("full", "qv", None):
        lr = None if name is None else reqs[name]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=lr)
        _check(outs, refs, [name] * len(prompts), prompts)
    assert llm.stats()["prefix_cache_hits"] > 0
    assert_engine_clean(llm)


def test_one_adapter_slot_serves_two_adapters_in_turn(setup):
    model, adapters, prompts, refs = setup
    llm = _llm(model, max_loras=1, enforce_eager=True, max_cpu_loras=1)
    reqs = [LoRARequest(n, i + 1, str(p)) for i, (n, p) in enumerate(adapters.items())]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    which = ["full", "qv", "full", "qv", None]
    lora = [reqs[0], reqs[1], reqs[0], reqs[1], None]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=lora)
    _check(outs, refs, which, prompts)


def test_prefix_cache_keys_by_adapter(setup):
    """The same prompt under another adapter finds no cached block of the first."""
    model, adapters, prompts, _ = setup
    llm = _llm(model, enforce_eager=True)
    kv = llm.engine.block_manager
    full = LoRARequest("full", 1, str(adapters["full"]))
    params = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate({"prompt_token_ids": prompts[2]}, params, lora_request=full)
    hits = kv.prefix_hits
    llm.generate({"prompt_token_ids": prompts[2]}, params)  # the base: no hit
    assert kv.prefix_hits == hits
    llm.generate({"prompt_token_ids": prompts[2]}, params, lora_request=full)
    assert kv.prefix_hits == hits + 1


def test_bad_adapters_are_refused_by_name_and_the_engine_serves_on(setup, tmp_path):
    model, adapters, prompts, refs = setup
    llm = _llm(model, enforce_eager=True, max_lora_rank=4)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    prompt = {"prompt_token_ids": prompts[0]}
    other = make_tiny_model("qwen2", tmp_path / "qwen2")  # NOTE: other shapes than the Llama's
    cases = {
        "r=8 is above max_lora_rank=4": LoRARequest("full", 1, str(adapters["full"])),
        "missing": LoRARequest("gone", 2, str(tmp_path / "missing")),
        "q_proj is 64 -> 64, the model's is 72": LoRARequest(
            "other", 3, str(make_adapter(tmp_path / "o", other, r=2))
        ),
        "no adaptable linear 'model.layers.7.self_attn.q_proj'": LoRARequest(
            "deep", 6, str(_moved_layer(adapters["qv"], tmp_path / "deep"))
        ),
    }
    for words, req in cases.items():
        with pytest.raises(InvalidRequestError, match=words):
            llm.generate(prompt, params, lora_request=req)
    qv = LoRARequest("qv", 4, str(adapters["qv"]))
    with pytest.raises(InvalidRequestError, match="already loaded from"):
        llm.generate(prompt, params, lora_request=[qv])  # NOTE: loads qv (fine) ...
        llm.generate(prompt, params, lora_request=LoRARequest("qv", 5, str(adapters["full"])))
    _check(llm.generate(prompt, params, lora_request=qv), refs, ["qv"], prompts)
    base = LLM(str(model), enforce_eager=True, max_model_len=96)
    with pytest.raises(InvalidRequestError, match="enable_lora=True"):
        base.generate(prompt, params, lora_request=qv)
    assert_engine_clean(llm)


def _moved_layer(adapter, out):
    """``adapter`` with its layer-0 tensors renamed to a layer 7 the model lacks."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(adapter, out)
    tensors = load_file(out / "adapter_model.safetensors")
    moved = {k.replace("layers.0.", "layers.7."): v for k, v in tensors.items()}
    save_file(moved, out / "adapter_model.safetensors")
    return out


def test_an_unloaded_name_loaded_again_serves_the_new_adapter(setup):
    """Unload, then load another adapter under the same name: its weights, not the stale
    ones left in the slot or the host cache."""
    model, adapters, prompts, refs = setup
    llm = _llm(model, enforce_eager=True)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    prompt = {"prompt_token_ids": prompts[0]}
    first = LoRARequest("x", 1, str(adapters["qv"]))
    _check(llm.generate(prompt, params, lora_request=first), refs, ["qv"], prompts)
    llm.engine.lora.remove("x")
    with pytest.raises(KeyError):
        llm.engine.lora.remove("x")
    second = LoRARequest("x", 2, str(adapters["full"]))
    _check(llm.generate(prompt, params, lora_request=second), refs, ["full"], prompts)


def test_an_adapter_given_as_the_model_says_how_to_serve_it(setup):
    _, adapters, _, _ = setup
    with pytest.raises(FileNotFoundError, match="is a LoRA adapter .*--enable-lora --lora-modules"):
        LLM(str(adapters["qv"]))
