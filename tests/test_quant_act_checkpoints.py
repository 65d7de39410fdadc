"""``tests/quant_act_checkpoints``: W8A8 int8 / FP8 checkpoints read back to their reference, and
the reference's input fake quantization checked against the libraries that run on the CPU.

compressed-tensors 0.20 (``.venv-quant/site`` or ``$WARMBOOT_QUANT_SITE``, in a subprocess) runs
its own quantized forward here: transformers loads ``out_dir`` with the default
``CompressedTensorsConfig`` (``dequantize=False``), which keeps compressed-tensors' input QDQ on
every linear. transformers' own FP8 path (``quant_method: fp8``) needs CUDA/XPU (the
``kernels-community/finegrained-fp8`` Triton kernel or DeepGEMM): on the CPU it only dequantizes
the weights, so the DeepSeek activation quantizer is checked against its kernel source instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import tests.quant_act_checkpoints as qac
from tests.quant_act_checkpoints import (
    BLOCK,
    WEIGHTS_NAME,
    InputQuant,
    input_quantizers,
    reference_model,
    write_act_quantized,
)

ROOT = Path(__file__).resolve().parent.parent
QUANT_SITE = Path(os.environ.get("WARMBOOT_QUANT_SITE", ROOT / ".venv-quant/site"))
INSTALL = "pip install --no-deps --target .venv-quant/site -r tests/quant/requirements.txt"
IDS = (torch.arange(40) * 37 % 500 + 3)[None]
TOL = 1e-5  # relative to max |logit|
CASES = {  # name: (dense model, fmt, variant, ignore)
    "ct-w8a8-dynamic": ("block", "ct-w8a8", "dynamic", ("lm_head",)),
    "ct-w8a8-dynamic-qwen2": ("qwen2", "ct-w8a8", "dynamic", ("lm_head",)),  # biases
    "ct-w8a8-static": ("block", "ct-w8a8", "static", ("lm_head", "re:.*1.mlp.down_proj")),
    "ct-fp8-dynamic": ("block", "ct-fp8", "dynamic", ("lm_head",)),
    "ct-fp8-static": ("block", "ct-fp8", "static", ("lm_head",)),
    "ct-fp8-block": ("block", "ct-fp8", "block", ("lm_head",)),
    "fp8-block": ("block", "fp8-block", "float", ("lm_head", "model.layers.1.mlp.down_proj")),
    "fp8-block-ue8m0": ("block", "fp8-block", "ue8m0", ("lm_head",)),
}
CT_CASES = [name for name in CASES if CASES[name][1] != "fp8-block"]
FP8_CASES = [name for name in CASES if CASES[name][1] == "fp8-block"]


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, tuple[Path, Path, Path]]:
    from tests.tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("quant_act")
    dense = {
        "block": qac.make_block_model(root / "block"),
        "qwen2": make_tiny_model("qwen2", root / "qwen2"),
    }
    dirs = {}
    for name, (kind, fmt, variant, ignore) in CASES.items():
        out, ref = root / name / "out", root / name / "ref"
        write_act_quantized(dense[kind], out, ref, fmt, variant=variant, ignore=ignore)
        dirs[name] = (dense[kind], out, ref)
    return dirs


def _qconfig(out_dir: Path) -> dict:
    return json.loads((out_dir / "config.json").read_text())["quantization_config"]


def _grid(qc: dict, shape) -> tuple[int, int]:
    """Weights per scale, from the config alone (never from the tensors' shapes)."""
    if qc["quant_method"] == "fp8":
        return tuple(qc["weight_block_size"])
    weights = qc["config_groups"]["group_0"]["weights"]
    if weights["strategy"] == "block":
        return tuple(weights["block_structure"])
    return {"channel": (1, shape[1]), "tensor": tuple(shape)}[weights["strategy"]]


def _dequant(codes: torch.Tensor, scale: torch.Tensor, grid) -> torch.Tensor:
    """codes * scale, one scale cell at a time (float64)."""
    scale = scale.reshape(1, 1) if scale.numel() == 1 else scale
    out = torch.empty(codes.shape, dtype=torch.float64)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            cell = (slice(i * grid[0], (i + 1) * grid[0]), slice(j * grid[1], (j + 1) * grid[1]))
            out[cell] = codes[cell].double() * float(scale[i, j])
    return out


def read_back(out_dir: Path, grid_of=_grid) -> dict[str, tuple[torch.Tensor, torch.Tensor, tuple]]:
    """module -> (codes, dequantized float64 weight, grid) for every quantized linear."""
    qc, t = _qconfig(out_dir), load_file(str(out_dir / WEIGHTS_NAME))
    suffix = ".weight_scale_inv" if qc["quant_method"] == "fp8" else ".weight_scale"
    decoded = {}
    for key in (k for k in t if k.endswith(suffix)):
        module = key.removesuffix(suffix)
        codes, scale = t[f"{module}.weight"], t[key]
        assert scale.dtype == torch.float32, key
        grid = grid_of(qc, codes.shape) if grid_of is _grid else grid_of(codes, scale)
        rows, cols = -(-codes.shape[0] // grid[0]), -(-codes.shape[1] // grid[1])
        assert scale.numel() == rows * cols, key
        decoded[module] = (codes, _dequant(codes, scale.reshape(rows, cols), grid), grid)
    return decoded


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip(written, case):
    """Each quantized linear reads back to the reference weight exactly, its codes are as
    tight as the format's scale rule makes them, and everything else is the dense model's."""
    dense_dir, out_dir, ref_dir = written[case]
    _, fmt, variant, _ = CASES[case]
    dense, out, ref = (load_file(str(d / WEIGHTS_NAME)) for d in (dense_dir, out_dir, ref_dir))
    decoded = read_back(out_dir)
    assert decoded and "lm_head" not in decoded
    for module, (codes, weight, grid) in decoded.items():
        name = f"{module}.weight"
        assert torch.equal(weight.float(), ref[name]), module
        assert codes.dtype == (torch.int8 if fmt == "ct-w8a8" else torch.float8_e4m3fn)
        cells = qac._cell_amax(codes.float(), grid)
        if fmt == "ct-w8a8":
            assert set(cells.unique().tolist()) <= {127.0, 128.0}, module
        elif variant == "ue8m0":  # power-of-two scales: amax / s in (224, 448], fp8-rounded
            assert bool(((cells >= 224) & (cells <= 448)).all()), module
        else:
            assert bool((cells == 448).all()), module
        assert (weight - dense[name].double()).abs().max() <= 0.07 * dense[name].abs().max()
    for name, tensor in dense.items():
        if name.removesuffix(".weight") not in decoded:
            assert torch.equal(out[name], tensor) and torch.equal(ref[name], tensor), name
    has_input_scale = {k.removesuffix(".input_scale") for k in out if k.endswith("input_scale")}
    assert has_input_scale == (set(decoded) if variant == "static" else set())
    assert not any(k.endswith("zero_point") for k in out)
    assert "quantization_config" not in json.loads((ref_dir / "config.json").read_text())


def test_partial_blocks_and_shape_inferred_block_break(written):
    """k/v_proj (192, 128) end in a half block: (2, 1) scales, the tail rows use row block 1.
    Deliberate break: a reader that infers the block from the shapes (192 / 2 = 96 rows, as
    transformers 5.23's CPU ``Fp8Dequantize`` does) misreads them."""
    _, out_dir, ref_dir = written["fp8-block"]
    t, ref = load_file(str(out_dir / WEIGHTS_NAME)), load_file(str(ref_dir / WEIGHTS_NAME))
    assert t["model.layers.0.self_attn.k_proj.weight_scale_inv"].shape == (2, 1)
    inferred = read_back(out_dir, lambda c, s: (c.shape[0] // s.shape[0], c.shape[1] // s.shape[1]))
    wrong = [
        m for m, (_, w, _) in inferred.items() if not torch.equal(w.float(), ref[f"{m}.weight"])
    ]
    assert wrong and all(m.endswith(("k_proj", "v_proj")) for m in wrong)


def test_configs(written):
    qc = _qconfig(written["fp8-block"][1])
    assert qc == {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["model.layers.1.mlp.down_proj"],
    }
    assert _qconfig(written["fp8-block-ue8m0"][1])["scale_fmt"] == "ue8m0"
    # compressed-tensors' configs: compared with the library's own (test_compressed_tensors_*)


@pytest.mark.parametrize("case", ["ct-w8a8-static", "ct-fp8-static"])
def test_static_scales_shared_and_clamped(written, case):
    """q/k/v (and gate/up) share one input scale; the test prompt overflows some of them, so an
    engine must clamp."""
    _, out_dir, ref_dir = written[case]
    t = load_file(str(out_dir / WEIGHTS_NAME))
    layer = "model.layers.0"
    scale = {m: t[f"{layer}.{m}.input_scale"] for m in ("self_attn.q_proj", "mlp.gate_proj")}
    for a, b in [("q_proj", "k_proj"), ("q_proj", "v_proj"), ("gate_proj", "up_proj")]:
        part = "self_attn" if a == "q_proj" else "mlp"
        assert torch.equal(
            t[f"{layer}.{part}.{a}.input_scale"], t[f"{layer}.{part}.{b}.input_scale"]
        )
    assert not torch.equal(scale["self_attn.q_proj"], scale["mlp.gate_proj"])
    model, peak = reference_model(ref_dir, out_dir), []
    qmax = 127.5 if case.startswith("ct-w8a8") else 448.0
    for name, quant in input_quantizers(out_dir).items():
        module = model.get_submodule(name)
        record = lambda m, a, s=quant.scale: peak.append(a[0].abs().max() / s)  # noqa: E731
        module.register_forward_pre_hook(record, prepend=True)  # before the quantizer
    with torch.no_grad():
        model(IDS)
    assert max(float(p) for p in peak) > qmax


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("case", list(CASES))
def test_input_quantization_changes_logits(written, case):
    """An engine that skipped the activation quantization would be caught: the hooks move the
    logits well past the comparison tolerance (and stay a small perturbation)."""
    _, out_dir, ref_dir = written[case]
    model = reference_model(ref_dir, out_dir)
    assert len(model.act_quant_handles) == len(read_back(out_dir))
    quantized = _logits(model)
    for handle in model.act_quant_handles:
        handle.remove()
    assert 1e3 * TOL < _rel(quantized, _logits(model)) < 0.3


def test_ue8m0_activation_scales_matter(written):
    _, out_dir, ref_dir = written["fp8-block-ue8m0"]
    model = reference_model(ref_dir, out_dir)
    pow2 = _logits(model)
    for handle in model.act_quant_handles:
        handle.remove()
    plain = {name: InputQuant("deepseek", True, BLOCK) for name in input_quantizers(out_dir)}
    qac.attach_input_quantizers(model, plain)
    assert _rel(pow2, _logits(model)) > 1e3 * TOL


def _kernel_literal(x: torch.Tensor, scale_fmt: str | None) -> torch.Tensor:
    """DeepSeek-V3 inference/kernel.py (commit 9b4e978) ``act_quant_kernel``, one 128-value
    program at a time, in fp32 as the kernel computes:
        x = tl.load(x_ptr + offs).to(tl.float32)
        amax = tl.max(tl.abs(x)) # reduction
        amax = tl.maximum(amax, 1e-4) # clamp to 1e-4
        s = amax / 448.
        if scale_fmt == "ue8m0":
            exp = tl.math.ceil(tl.math.log2(s))
            s = tl.math.exp2(exp)
        y = x / s
        y = y.to(y_ptr.dtype.element_ty)
    ``fp8_gemm_kernel`` then scales each K-block's products by a_s (times the weight's b_s)."""
    blocks = x.float().reshape(-1, 128)
    out = torch.empty_like(blocks)
    for i, block in enumerate(blocks):
        amax = torch.maximum(block.abs().max(), torch.tensor(1e-4))
        s = amax / 448.0
        if scale_fmt == "ue8m0":
            s = torch.exp2(torch.ceil(torch.log2(s)))
        out[i] = (block / s).to(torch.float8_e4m3fn).float() * s
    return out.reshape(x.shape)


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_deepseek_input_quant_is_the_kernel_formula(scale_fmt):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 384, generator=gen) * torch.logspace(-3, 2, 5)[None, :, None]
    x[0, 0] = 0.0  # a zero row: amax floored at 1e-4
    x[0, 1, :128] *= 1e-4  # amax below the floor
    x[1, 0, :128] = torch.linspace(-1.75, 1.75, 128)  # s = 1.75 / 448 = 2**-8 exactly
    x[1, 0, 1] = 2.0**-17  # an fp8 subnormal at s = 2**-8, zero at twice that s
    quant = InputQuant("deepseek", True, BLOCK, pow2=scale_fmt == "ue8m0")
    assert torch.equal(quant(x), _kernel_literal(x, scale_fmt))


# --- the libraries themselves, in a subprocess (they must not leak into this process) ---


@pytest.fixture(scope="module")
def library(written, tmp_path_factory) -> tuple[dict, Path]:
    if not (QUANT_SITE / "compressed_tensors").is_dir():
        pytest.skip(f"compressed-tensors 0.20 is not in {QUANT_SITE}: {INSTALL}")
    cache = tmp_path_factory.mktemp("act_lib")
    probe = torch.randn(2, 9, 384, generator=torch.Generator().manual_seed(5)) * 2
    probe[0, 0], probe[1, 3] = 0.0, probe[1, 3] * 40  # a zero token, an outlier token
    torch.save(probe, cache / "probe.pt")
    jobs = {name: [str(p) for p in written[name][1:]] + list(CASES[name][1:3]) for name in CASES}
    env = os.environ | {
        "PYTHONPATH": f"{QUANT_SITE}{os.pathsep}{ROOT}",
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
    }
    cmd = [sys.executable, "-m", "tests.test_quant_act_checkpoints", json.dumps(jobs), str(cache)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), cache


def _result(library, case: str) -> dict:
    result = library[0][case]
    assert "error" not in result, result["error"]
    return result


@pytest.mark.parametrize("case", CT_CASES)
def test_compressed_tensors_forward_is_reference(written, library, case):
    """compressed-tensors' own quantized forward gives the reference's logits, its weights are
    the reference's, its config is ours, and its input QDQ is the reference's bit for bit."""
    result, cache = _result(library, case), library[1]
    assert result["config_as_library_writes"] and result["weights_equal"], result
    _, out_dir, ref_dir = written[case]
    lib_logits = torch.load(cache / f"{case}.logits.pt")
    assert _rel(lib_logits, _logits(reference_model(ref_dir, out_dir))) <= TOL
    probe, lib_qdq = torch.load(cache / "probe.pt"), torch.load(cache / f"{case}.qdq.pt")
    quantizers = input_quantizers(out_dir)
    assert set(lib_qdq) == set(quantizers)
    for name, quant in quantizers.items():
        x = probe[..., : lib_qdq[name].shape[-1]]
        assert torch.equal(quant(x), lib_qdq[name]), name


def test_deliberate_break_caught_by_compressed_tensors(written, library, monkeypatch):
    """Two engine mistakes the library comparison catches: no input quantization at all, and
    int8 scales of amax / 127 instead of compressed-tensors' amax / 127.5."""
    _result(library, "ct-w8a8-dynamic")
    _, out_dir, ref_dir = written["ct-w8a8-dynamic"]
    lib_logits = torch.load(library[1] / "ct-w8a8-dynamic.logits.pt")
    model = reference_model(ref_dir, out_dir)
    monkeypatch.setattr(qac, "INT8_HALF_RANGE", 127.0)
    assert _rel(lib_logits, _logits(model)) > 10 * TOL
    for handle in model.act_quant_handles:
        handle.remove()
    assert _rel(lib_logits, _logits(model)) > 10 * TOL


@pytest.mark.parametrize("case", FP8_CASES)
def test_transformers_cpu_fallback_dequantizes_full_blocks(written, library, case):
    """On the CPU transformers 5.23 loads ``quant_method: fp8`` as plain dequantized Linears (no
    activation quantization to compare); their weights are the reference's wherever both dims
    are whole blocks (the partial k/v blocks it misreads: see the break test above)."""
    result = _result(library, case)
    assert result["linear_classes"] == ["Linear"], result
    full = {m for m, (c, _, _) in read_back(written[case][1]).items() if c.shape[0] % BLOCK == 0}
    assert full and not full & {k.removesuffix(".weight") for k in result["differs"]}, result


def _ct_config_as_library_writes(fmt: str, variant: str, ignore: list, work: Path) -> dict:
    from compressed_tensors import quantization as ctq
    from compressed_tensors.compressors import ModelCompressor

    presets = {"ct-w8a8": "W8A8", "dynamic": "FP8_DYNAMIC", "static": "FP8", "block": "FP8_BLOCK"}
    scheme = ctq.preset_name_to_scheme(presets[fmt if fmt == "ct-w8a8" else variant], ["Linear"])
    if fmt == "ct-w8a8" and variant == "static":  # W8A8 with a static per-tensor input
        scheme.input_activations = ctq.QuantizationArgs(strategy="tensor", dynamic=False)
    scheme.format = "float-quantized" if fmt == "ct-fp8" else "int-quantized"
    config = ctq.QuantizationConfig(
        config_groups={"group_0": scheme},
        ignore=ignore,
        format=scheme.format,
        quantization_status="compressed",
    )
    work.mkdir()
    (work / "config.json").write_text("{}")
    ModelCompressor(quantization_config=config).update_config(str(work))
    return json.loads((work / "config.json").read_text())["quantization_config"]


def _lib_case(name: str, job: list, cache: Path) -> dict:
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize
    from transformers import AutoModelForCausalLM

    out, ref, fmt, variant = Path(job[0]), Path(job[1]), job[2], job[3]
    model = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ref_state = load_file(str(ref / WEIGHTS_NAME))
    logits = _logits(model)  # the first forward decompresses compressed-tensors' weights
    state = model.state_dict()
    if fmt == "fp8-block":
        kinds = {type(m).__name__ for n, m in model.named_modules() if n.endswith("_proj")}
        differs = sorted(k for k, v in ref_state.items() if not torch.equal(state[k], v))
        return {"linear_classes": sorted(kinds), "differs": differs}
    probe, qdq = torch.load(cache / "probe.pt"), {}
    for module_name, module in model.named_modules():
        args = getattr(getattr(module, "quantization_scheme", None), "input_activations", None)
        if args is not None:
            x = probe[..., : module.in_features]
            qdq[module_name] = forward_quantize(module, x, "input", args)
    torch.save(logits, cache / f"{name}.logits.pt")
    torch.save(qdq, cache / f"{name}.qdq.pt")
    return {
        "config_as_library_writes": _ct_config_as_library_writes(
            fmt, variant, _qconfig(out)["ignore"], cache / f"{name}-config"
        )
        == _qconfig(out),
        "weights_equal": all(torch.equal(state[k], v) for k, v in ref_state.items()),
    }


def _library_main(jobs: dict, cache: Path) -> dict:
    warnings.filterwarnings("ignore")
    results = {}
    for name, job in jobs.items():
        try:
            results[name] = _lib_case(name, job, cache)
        except Exception as exc:  # reported by the test of that case
            results[name] = {"error": f"{type(exc).__name__}: {exc}"[-3000:]}
    return results


if __name__ == "__main__":
    print(json.dumps(_library_main(json.loads(sys.argv[1]), Path(sys.argv[2]))))
