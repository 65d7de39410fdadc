"""``tests/quant_checkpoints``: the quantized checkpoints it writes read back to its reference.

Each layout is read here a second way (bytes split into fields, not shifts; each format's
conventions restated from the tools' code), then, in a subprocess with the libraries of
``tests/quant/requirements.txt`` (``.venv-quant/site`` or ``$WARMBOOT_QUANT_SITE``), by
compressed-tensors 0.20's own decompressors and converter, AutoAWQ's ``dequantize_gemm`` and
its AWQ-to-GPTQ (exllama) repacking, and transformers' compressed-tensors loader.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.quant_checkpoints import WEIGHTS_NAME, write_quantized

ROOT = Path(__file__).resolve().parent.parent
QUANT_SITE = Path(os.environ.get("WARMBOOT_QUANT_SITE", ROOT / ".venv-quant/site"))
INSTALL = "pip install --no-deps --target .venv-quant/site -r tests/quant/requirements.txt"
AWQ_REVERSE = [0, 4, 1, 5, 2, 6, 3, 7]  # field holding channel c of a word (AutoAWQ)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WEIGHTS = tuple(f"{name}.weight" for name in LINEARS + ("lm_head",))
SKIP = ("model.layers.1.self_attn.q_proj",)  # and lm_head quantized
CASES = {
    "ct-pack-g16-sym": ("qwen3", "ct-pack", dict(group_size=16)),
    "ct-pack-g16-asym": ("qwen3", "ct-pack", dict(group_size=16, sym=False)),
    "ct-pack-8bit-g16-asym": ("qwen3", "ct-pack", dict(bits=8, group_size=16, sym=False)),
    # llama: in 100 and out 100 pad the packed words and zero points
    "ct-pack-chan-asym-llama": ("llama", "ct-pack", dict(group_size=None, sym=False, ignore=SKIP)),
    "ct-int-chan-sym": ("qwen3", "ct-int", dict(bits=8, group_size=None)),
    "ct-int-g16-asym": ("qwen3", "ct-int", dict(bits=8, group_size=16, sym=False)),
    "gptq-g16-sym": ("qwen3", "gptq", dict(group_size=16)),
    "gptq-g16-asym": ("qwen3", "gptq", dict(group_size=16, sym=False)),
    "gptq-g16-asym-actorder": ("qwen3", "gptq", dict(group_size=16, sym=False, act_order=True)),
    "gptq-8bit-g16-sym-actorder": ("qwen3", "gptq", dict(bits=8, group_size=16, act_order=True)),
    "gptq-chan-asym": ("qwen3", "gptq", dict(group_size=None, sym=False, ignore=("re:.*k_proj",))),
    "awq-g16-asym": ("qwen3", "awq", dict(group_size=16, sym=False)),
    "awq-g16-sym": ("qwen3", "awq", dict(group_size=16, ignore=("lm_head", "re:.*up_proj"))),
}
CT_CASES = [name for name in CASES if name.startswith("ct-")]


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, tuple[Path, Path, Path]]:
    from tests.tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("quant")
    dense = {kind: make_tiny_model(kind, root / kind) for kind in ("qwen3", "llama")}
    dirs = {}
    for name, (kind, fmt, kwargs) in CASES.items():
        out, ref = root / name / "out", root / name / "ref"
        write_quantized(dense[kind], out, ref, fmt, **kwargs)
        dirs[name] = (dense[kind], out, ref)
    return dirs


def _fields(words: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., n) int32 words -> (..., n * 32 / bits) fields, lowest first, through the words'
    little-endian bytes (a nibble pair per byte for 4 bits)."""
    raw = words.contiguous().numpy().astype("<i4").view(np.uint8).reshape(*words.shape, 4)
    if bits == 4:
        raw = np.stack([raw & 0xF, raw >> 4], -1)
    return torch.from_numpy(raw.reshape(*words.shape[:-1], -1).astype(np.int64))


def _read_ct(t: dict, module: str, qc: dict, in_f: int) -> tuple[torch.Tensor, torch.Tensor]:
    weights = qc["config_groups"]["group_0"]["weights"]
    bits, half = weights["num_bits"], 2 ** (weights["num_bits"] - 1)
    scale = t[f"{module}.weight_scale"].double()
    if qc["format"] == "pack-quantized":
        out_f, in_f = t[f"{module}.weight_shape"].tolist()
        assert t[f"{module}.weight_packed"].shape == (out_f, -(-in_f * bits // 32))
        q = _fields(t[f"{module}.weight_packed"], bits)[:, :in_f] - half  # signed int values
        zp = t.get(f"{module}.weight_zero_point")
        if zp is not None:  # packed along the output dim
            zp = _fields(zp.T, bits)[:, :out_f].T - half
    else:
        q, zp = t[f"{module}.weight"], t.get(f"{module}.weight_zero_point")
        assert q.dtype == torch.int8 and (zp is None or zp.dtype == torch.int8)
        q, zp = q.long(), zp if zp is None else zp.long()
    assert (zp is None) == weights["symmetric"]
    zp = torch.zeros_like(scale, dtype=torch.int64) if zp is None else zp
    groups = torch.arange(q.shape[1]) // (weights["group_size"] or q.shape[1])
    assert scale.shape == zp.shape == (q.shape[0], int(groups[-1]) + 1)
    return q + half, (q - zp[:, groups]).double() * scale[:, groups]


def _read_gptq(t: dict, module: str, qc: dict, in_f: int) -> tuple[torch.Tensor, torch.Tensor]:
    bits = qc["bits"]
    assert qc["checkpoint_format"] == "gptq" and t[f"{module}.scales"].dtype == torch.float16
    qweight, g_idx = t[f"{module}.qweight"], t[f"{module}.g_idx"].long()
    assert qweight.shape[0] * 32 // bits == in_f and t[f"{module}.g_idx"].dtype == torch.int32
    u = _fields(qweight.T, bits)  # (out, in)
    zeros = _fields(t[f"{module}.qzeros"], bits) + 1  # v1 stores zero - 1
    scales = t[f"{module}.scales"].double()
    assert zeros.shape == scales.shape == (int(g_idx.max()) + 1, qweight.shape[1])
    return u, ((u.T - zeros[g_idx]) * scales[g_idx]).T


def _read_awq(t: dict, module: str, qc: dict, in_f: int) -> tuple[torch.Tensor, torch.Tensor]:
    assert qc["version"] == "gemm" and qc["zero_point"] and qc["bits"] == 4
    assert t[f"{module}.scales"].dtype == torch.float16

    def unpack(words: torch.Tensor) -> torch.Tensor:
        fields = _fields(words, 4).reshape(words.shape[0], -1, 8)
        return fields[:, :, AWQ_REVERSE].reshape(words.shape[0], -1)

    u, zeros = unpack(t[f"{module}.qweight"]), unpack(t[f"{module}.qzeros"])  # (in, out), (G, out)
    groups = torch.arange(in_f) // qc["group_size"]
    scales = t[f"{module}.scales"].double()
    assert u.shape[0] == in_f and zeros.shape == scales.shape
    return u.T, ((u - zeros[groups]) * scales[groups]).T


READERS = {"compressed-tensors": _read_ct, "gptq": _read_gptq, "awq": _read_awq}


def read_back(out_dir: Path, dense: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module -> (unsigned codes, dequantized float64 weight) for every quantized linear."""
    qc = json.loads((out_dir / "config.json").read_text())["quantization_config"]
    t = _load(out_dir)
    modules = {k.rsplit(".", 1)[0] for k in t if k.endswith(("weight_scale", ".qweight"))}
    read = READERS[qc["quant_method"]]
    return {m: read(t, m, qc, dense[f"{m}.weight"].shape[1]) for m in sorted(modules)}


def _load(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(directory / WEIGHTS_NAME))


def _ignored(module: str, ignore) -> bool:  # compressed-tensors' match_name
    return any(re.match(i[3:], module) if i.startswith("re:") else i == module for i in ignore)


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip(written, case):
    """Every quantized linear reads back to the reference weight exactly; the codes span the
    whole range; everything else is the dense checkpoint's."""
    dense_dir, out_dir, ref_dir = written[case]
    kwargs = CASES[case][2]
    bits, ignore = kwargs.get("bits", 4), kwargs.get("ignore", ("lm_head",))
    dense, ref, out = _load(dense_dir), _load(ref_dir), _load(out_dir)
    decoded = read_back(out_dir, dense)
    linears = {k.removesuffix(".weight") for k in dense if k.endswith(WEIGHTS)}
    assert set(decoded) == {m for m in linears if not _ignored(m, ignore)}
    codes = torch.cat([u.flatten() for u, _ in decoded.values()])
    assert int(codes.min()) == 0 and int(codes.max()) == 2**bits - 1
    for module, (_, weight) in decoded.items():
        name = f"{module}.weight"
        assert torch.equal(weight.to(dense[name].dtype), ref[name]), module
        step = (weight.double() - dense[name].double()).abs().max()
        assert step <= 0.2 * dense[name].abs().max(), module  # a RTN of this weight
        assert name not in out or out[name].dtype == torch.int8  # ct-int's int8 weight
    for name, tensor in dense.items():
        if name.rsplit(".", 1)[0] not in decoded:
            assert torch.equal(out[name], tensor) and torch.equal(ref[name], tensor), name
    config = json.loads((ref_dir / "config.json").read_text())
    assert "quantization_config" not in config


def test_act_order_groups(written):
    _, out_dir, _ = written["gptq-g16-asym-actorder"]
    t = _load(out_dir)
    g_idx = [t[k].long() for k in sorted(t) if k.endswith(".g_idx")]
    for g in g_idx:
        assert not bool((g[1:] >= g[:-1]).all())  # a permutation, not sorted groups
        assert torch.bincount(g).tolist() == [16] * (len(g) // 16)
    assert not torch.equal(g_idx[0], g_idx[1])
    qc = json.loads((out_dir / "config.json").read_text())["quantization_config"]
    assert qc["desc_act"] is True and qc["group_size"] == 16


def _swap_nibbles(x: torch.Tensor) -> torch.Tensor:
    raw = x.contiguous().numpy().view(np.uint8)
    return torch.from_numpy(((raw >> 4) | ((raw & 0xF) << 4)).view(np.int32).copy())


BREAKS = {  # a layout mistake a loader could make, applied to the file
    "ct-pack-g16-asym": ("weight_packed", _swap_nibbles),
    "ct-pack-chan-asym-llama": ("weight_zero_point", _swap_nibbles),
    "gptq-g16-asym": ("qzeros", lambda z: z + 0x11111111),
    "gptq-g16-sym": ("qweight", _swap_nibbles),
    "awq-g16-asym": ("qweight", _swap_nibbles),
}


@pytest.mark.parametrize("case", list(BREAKS))
def test_broken_layout_is_caught(written, case, tmp_path):
    dense_dir, out_dir, ref_dir = written[case]
    suffix, breaker = BREAKS[case]
    shutil.copytree(out_dir, tmp_path / "out")
    broken = {k: breaker(v) if k.endswith(suffix) else v for k, v in _load(out_dir).items()}
    save_file({k: v.contiguous() for k, v in broken.items()}, str(tmp_path / "out" / WEIGHTS_NAME))
    ref, decoded = _load(ref_dir), read_back(tmp_path / "out", _load(dense_dir))
    assert any(not torch.equal(w.float(), ref[f"{m}.weight"]) for m, (_, w) in decoded.items())


def test_unsupported_layouts_refused(written, tmp_path):
    dense_dir = written["ct-pack-chan-asym-llama"][0]  # in/out 100: no AWQ words, no CT groups
    for fmt, kwargs in [("awq", {}), ("ct-pack", {"group_size": 16}), ("ct-int", {"bits": 4})]:
        with pytest.raises(ValueError):
            write_quantized(dense_dir, tmp_path / "o", tmp_path / "r", fmt, **kwargs)


# --- the libraries themselves, in a subprocess (they must not leak into this process) ---


@pytest.fixture(scope="module")
def library(written, tmp_path_factory) -> dict:
    if not (QUANT_SITE / "compressed_tensors").is_dir():
        pytest.skip(f"compressed-tensors 0.20 is not in {QUANT_SITE}: {INSTALL}")
    names = CT_CASES + ["awq-g16-asym", "awq-g16-sym", "gptq-g16-asym"]
    jobs = {name: [str(p) for p in written[name]] + [CASES[name][2]] for name in names}
    cache = tmp_path_factory.mktemp("lib")
    env = os.environ | {"PYTHONPATH": f"{QUANT_SITE}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "tests.test_quant_checkpoints", json.dumps(jobs), str(cache)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _result(library: dict, case: str) -> dict:
    result = library[case]
    if "skipped" in result:
        pytest.skip(result["skipped"])
    assert "error" not in result, result["error"]
    return result


@pytest.mark.parametrize("case", CT_CASES)
def test_compressed_tensors_decompresses_to_reference(library, case):
    result = _result(library, case)
    assert result["config_as_library_writes"], result
    assert result["modules"] > 0 and result["max_diff"] == 0.0, result


@pytest.mark.parametrize("case", CT_CASES)
def test_transformers_quantized_forward_is_reference(library, case):
    """transformers + compressed-tensors on out_dir gives the weights and logits of ref_dir."""
    result = _result(library, case)
    assert result["weights_equal"] and result["logits_max_diff"] <= 1e-5, result


@pytest.mark.parametrize("case", ["awq-g16-asym", "awq-g16-sym"])
def test_autoawq_and_ct_converter_read_awq(library, case):
    result = _result(library, case)
    assert result["autoawq_modules"] > 0 and result["autoawq_max_diff"] == 0.0, result
    assert result["ct_converter_max_diff"] == 0.0, result


def test_autoawq_repacks_awq_into_our_gptq(library):
    """AutoAWQ's AWQ -> exllama (GPTQ v1) repacking of the AWQ checkpoint gives our GPTQ
    checkpoint's qweight/qzeros bit for bit (same codes: both asymmetric, group 16)."""
    result = _result(library, "gptq-g16-asym")
    assert result["exllama_modules"] > 0 and result["exllama_equal"], result


def _ct_config_as_library_writes(kwargs: dict, name: str, cache: Path) -> dict:
    from compressed_tensors import quantization as ctq
    from compressed_tensors.compressors import ModelCompressor

    gs, ignore = kwargs.get("group_size", 32), list(kwargs.get("ignore", ("lm_head",)))
    weights = dict(num_bits=kwargs.get("bits", 4), symmetric=kwargs.get("sym", True), group_size=gs)
    args = ctq.QuantizationArgs(type="int", strategy="group" if gs else "channel", **weights)
    groups = {"group_0": ctq.QuantizationScheme(targets=["Linear"], weights=args, format=name)}
    config = ctq.QuantizationConfig(
        config_groups=groups, ignore=ignore, format=name, quantization_status="compressed"
    )
    (cache / "config.json").write_text("{}")
    ModelCompressor(quantization_config=config).update_config(str(cache))
    return json.loads((cache / "config.json").read_text())["quantization_config"]


def _lib_ct(out: Path, ref: Path, kwargs: dict, cache: Path) -> dict:
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    scheme = QuantizationConfig.model_validate(qc).config_groups["group_0"]
    compressor = BaseCompressor.get_value_from_registry(scheme.format)
    params = compressor.compression_param_names(scheme)
    t, r = _load(out), _load(ref)
    modules = [k.removesuffix(".weight_scale") for k in t if k.endswith(".weight_scale")]
    diff = 0.0
    for m in modules:
        weight = compressor.decompress({p: t[f"{m}.{p}"] for p in params}, scheme)["weight"]
        diff = max(diff, float((weight - r[f"{m}.weight"]).abs().max()))
    # dequantize=True (run_compressed=False): the default path keeps the meta model's
    # weight_zero_point unpacked (pack_quantized/base.py, meta branch) and refuses asymmetric files
    dequantize = CompressedTensorsConfig(dequantize=True)
    quantized = AutoModelForCausalLM.from_pretrained(out, quantization_config=dequantize)
    reference = AutoModelForCausalLM.from_pretrained(ref)
    ids = (torch.arange(40) * 37 % 500 + 3)[None]
    with torch.no_grad():
        logits = (quantized(ids).logits - reference(ids).logits).abs().max()
    q_state, r_state = quantized.state_dict(), reference.state_dict()
    return {
        "config_as_library_writes": _ct_config_as_library_writes(kwargs, qc["format"], cache) == qc,
        "modules": len(modules),
        "max_diff": diff,
        "logits_max_diff": float(logits),
        "weights_equal": q_state.keys() == r_state.keys()
        and all(torch.equal(v, r_state[k]) for k, v in q_state.items()),
    }


def _lib_awq(out: Path, ref: Path, kwargs: dict) -> dict:
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    packing = _autoawq_packing()
    gs = kwargs["group_size"]
    t, r = _load(out), _load(ref)
    modules = [k[: -len(".qweight")] for k in t if k.endswith(".qweight")]
    converter = AutoAWQConverter(bits=4, group_size=gs, zero_point=True)
    scheme = converter.update_config(None).config_groups["config_group_0"]
    compressor = BaseCompressor.get_value_from_registry(scheme.format)
    converted = converter.process(dict(t))
    awq_diff = ct_diff = 0.0
    for m in modules:
        weight = packing.dequantize_gemm(
            t[f"{m}.qweight"], t[f"{m}.qzeros"], t[f"{m}.scales"].double(), 4, gs
        ).T
        awq_diff = max(awq_diff, float((weight.float() - r[f"{m}.weight"]).abs().max()))
        sd = {p: converted[f"{m}.{p}"] for p in compressor.compression_param_names(scheme)}
        sd["weight_scale"] = sd["weight_scale"].double()  # exact, as our float64 dequantize
        weight = compressor.decompress(sd, scheme)["weight"].float()
        ct_diff = max(ct_diff, float((weight - r[f"{m}.weight"]).abs().max()))
    return {
        "autoawq_modules": len(modules),
        "autoawq_max_diff": awq_diff,
        "ct_converter_max_diff": ct_diff,
    }


def _lib_gptq_vs_awq(gptq_out: Path, awq_out: Path) -> dict:
    packing = _autoawq_packing()
    g, a = _load(gptq_out), _load(awq_out)
    modules = [k[: -len(".qweight")] for k in a if k.endswith(".qweight")]
    equal = True
    for m in modules:
        qweight, qzeros = packing.unpack_reorder_pack(a[f"{m}.qweight"], a[f"{m}.qzeros"], 4)
        equal &= torch.equal(qweight, g[f"{m}.qweight"]) and torch.equal(qzeros, g[f"{m}.qzeros"])
        equal &= torch.equal(a[f"{m}.scales"], g[f"{m}.scales"])
    return {"exllama_modules": len(modules), "exllama_equal": bool(equal)}


def _autoawq_packing():
    """AutoAWQ's awq/utils/packing_utils.py (torch only), without the package's heavy __init__."""
    path = QUANT_SITE / "awq" / "utils" / "packing_utils.py"
    spec = importlib.util.spec_from_file_location("autoawq_packing_utils", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _library_case(name: str, jobs: dict, cache: Path) -> dict:
    out, ref, kwargs = Path(jobs[name][1]), Path(jobs[name][2]), jobs[name][3]
    if CASES[name][1].startswith("ct-"):
        return _lib_ct(out, ref, kwargs, cache)
    if not (QUANT_SITE / "awq").is_dir():
        return {"skipped": f"autoawq is not in {QUANT_SITE}: {INSTALL}"}
    if CASES[name][1] == "awq":
        return _lib_awq(out, ref, kwargs)
    return _lib_gptq_vs_awq(out, Path(jobs["awq-g16-asym"][1]))


def _library_main(jobs: dict, cache: Path) -> dict:
    warnings.filterwarnings("ignore")
    results = {}
    for name in jobs:
        (cache / name).mkdir()
        try:
            results[name] = _library_case(name, jobs, cache / name)
        except Exception as exc:  # reported by the test of that case
            results[name] = {"error": f"{type(exc).__name__}: {exc}"[-3000:]}
    return results


if __name__ == "__main__":
    print(json.dumps(_library_main(json.loads(sys.argv[1]), Path(sys.argv[2]))))
