"""Peer driver for llama.cpp, built from source outside the repo and run through subprocesses.

Stdlib-only: the project venv never imports llama.cpp. The source is the llama.cpp tree that
the ``llama-cpp-python==<version>`` sdist vendors (``vendor/llama.cpp``); ``ensure_build``
unpacks it under ``<cache_root>/peers/llama.cpp-<version>/src``, builds ``llama-batched-bench``,
``llama-bench`` and ``llama-quantize`` (static, Release, ``GGML_NATIVE=ON``, no CUDA, no server /
web UI, no OpenSSL) and writes a marker file; delete the folder to rebuild.

The HF -> GGUF converter (``src/convert_hf_to_gguf.py``) runs with the project venv's python
(torch, transformers, safetensors, numpy) and the vendored ``gguf-py`` (the script puts it on
``sys.path`` itself), plus ``sentencepiece`` from ``pip install --target <root>/pydeps`` (the
converter imports it before it looks for a ``tokenizer.model``). Its pre-tokenizer check
rejects the demo tokenizer (an unknown BPE hash): the build tree's copy is patched to map the
hashes in ``$WARMBOOT_GPT2_PRE_HASHES`` to GPT-2's pre-tokenizer, and ``convert`` sets it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import struct
import subprocess
import sys
import tarfile
import time
from collections import Counter
from pathlib import Path

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
TARGETS = ("llama-batched-bench", "llama-bench", "llama-quantize")
_CMAKE = "CMAKE_BUILD_TYPE=Release GGML_NATIVE=ON GGML_CUDA=OFF LLAMA_CURL=OFF LLAMA_OPENSSL=OFF"
# no server / web UI (nothing downloaded), no tests / examples / unified app; static binaries
_CMAKE += " LLAMA_BUILD_SERVER=OFF LLAMA_BUILD_UI=OFF LLAMA_USE_PREBUILT_UI=OFF LLAMA_BUILD_APP=OFF"
_CMAKE += " LLAMA_BUILD_TESTS=OFF LLAMA_BUILD_EXAMPLES=OFF BUILD_SHARED_LIBS=OFF"
CMAKE_FLAGS = tuple(f"-D{x}" for x in _CMAKE.split())
# the converter's chkhsh of the demo tokenizer (warmboot/tokenizer/train.py, byte-level BPE)
DEMO_TOKENIZER_HASHES = ("3a088fcedbc4f145559a750b6bba92d982a6bb673e74d452937c2298952f8fb8",)
_PRE_ANCHOR = "        if res is None:\n            logger.warning"
_PRE_PATCH = (
    "        # warmboot peer patch: map these BPE hashes to GPT-2's pre-tokenizer\n"
    '        if res is None and chkhsh in os.environ.get("WARMBOOT_GPT2_PRE_HASHES", "").split(","):\n'
    '            res = "gpt-2"\n'
)
SENTENCEPIECE = "sentencepiece==0.2.3"
CONVERT_TYPES = ("f32", "bf16", "f16", "q8_0")
_VENDOR = "vendor/llama.cpp/"
_SUBMODULE_HEAD = ".git/modules/vendor/llama.cpp/HEAD"


# --- build --------------------------------------------------------------------------------


def _cache_root() -> Path:
    try:
        from warmboot.config import cache_root
    except ImportError:
        return Path.home() / ".cache" / "warmboot"
    return cache_root()


def root_dir() -> Path:
    """``<cache_root>/peers/llama.cpp-<llama-cpp-python version>``."""
    return _cache_root() / "peers" / f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}"


def src_dir() -> Path:
    return root_dir() / "src"


def _marker() -> Path:
    return root_dir() / ".warmboot-complete"


def _log(name: str) -> Path:
    (root_dir() / "logs").mkdir(parents=True, exist_ok=True)
    return root_dir() / "logs" / name


def _run_logged(msg: str, cmd: list[str], log: Path, **kw) -> None:
    print(f"[llama.cpp] {msg}: {' '.join(cmd)} (log: {log})", flush=True)
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, **kw).returncode
    if rc != 0:
        raise RuntimeError(f"{msg} failed (rc={rc}):\n{log.read_text()[-4000:]}")


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed (rc={out.returncode}):\n{out.stderr[-4000:]}")
    return out


def _download_sdist() -> Path:
    dest = root_dir() / "sdist"
    name = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    if not (dest / name).exists():
        spec = f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"
        cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps"]
        _run_logged("download sdist", [*cmd, "-d", str(dest), spec], _log("build.log"))
    return dest / name


def _unpack(sdist: Path) -> str:
    """Extract ``vendor/llama.cpp`` into ``src/``; return the vendored commit hash."""
    commit = "unknown"
    with tarfile.open(sdist) as tar:
        for m in tar.getmembers():
            rel = m.name.partition("/")[2]
            if rel == _SUBMODULE_HEAD:
                commit = tar.extractfile(m).read().decode().strip()
            # the submodule's .git file points outside the tree: skip it
            if rel.startswith(_VENDOR) and rel not in (_VENDOR, _VENDOR + ".git"):
                m.name = rel[len(_VENDOR) :]
                tar.extract(m, src_dir(), filter="data")
    return commit


def _patch_converter() -> None:
    path = src_dir() / "conversion" / "base.py"
    text = path.read_text()
    if _PRE_PATCH in text:
        return
    if text.count(_PRE_ANCHOR) != 1:
        raise RuntimeError(f"pre-tokenizer check not found in {path}")
    path.write_text(text.replace(_PRE_ANCHOR, _PRE_PATCH + _PRE_ANCHOR))


def ensure_build(jobs: int = 2) -> Path:
    """Build llama.cpp's bench / quantize tools once (~4.5 min on 2 cores); return the root."""
    if _marker().exists():
        return root_dir()
    t0 = time.perf_counter()
    commit = _unpack(_download_sdist())
    _patch_converter()
    log, build = _log("build.log"), root_dir() / "build"
    flags = [*CMAKE_FLAGS, f"-DLLAMA_BUILD_COMMIT={commit[:9]}", "-DLLAMA_BUILD_NUMBER=0"]
    cmake = ["cmake", "-S", str(src_dir()), "-B", str(build), "-G", "Ninja", *flags]
    _run_logged("configure", cmake, log)
    cmake = ["cmake", "--build", str(build), "-j", str(jobs), "--target", *TARGETS]
    _run_logged("build", cmake, log)
    info = {"llama_cpp_python": LLAMA_CPP_PYTHON_VERSION, "commit": commit, "cmake_flags": flags}
    info["build_s"] = round(time.perf_counter() - t0, 1)
    _marker().write_text(json.dumps(info) + "\n")
    print(f"[llama.cpp] ready in {info['build_s']} s: {build / 'bin'}", flush=True)
    return root_dir()


def build_info() -> dict:
    """The marker's content: sdist version, vendored llama.cpp commit, cmake flags."""
    return json.loads((ensure_build() / _marker().name).read_text())


def tool(name: str) -> Path:
    return ensure_build() / "build" / "bin" / name


@functools.cache
def version() -> str:
    """``llama-batched-bench --version`` (llama.cpp version, vendored commit, compiler)."""
    out = _run([str(tool("llama-batched-bench")), "--version"])
    return " / ".join(x.strip() for x in (out.stdout + out.stderr).splitlines() if x.strip())


# --- GGUF files ---------------------------------------------------------------------------

_GGML_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0"}
_GGML_TYPES |= {10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 30: "BF16"}
# GGUF metadata value types -> struct format (8: string, 9: array are handled apart)
_GGUF_SCALARS = dict(zip((*range(8), 10, 11, 12), "BbHhIif?Qqd", strict=True))


def _read(f, fmt: str):
    return struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))[0]


def _skip_value(f, vtype: int) -> None:
    if vtype == 8:
        f.seek(_read(f, "Q"), 1)
    elif vtype == 9:
        itype, n = _read(f, "I"), _read(f, "Q")
        if itype in _GGUF_SCALARS:
            f.seek(n * struct.calcsize(_GGUF_SCALARS[itype]), 1)
        else:
            for _ in range(n):
                _skip_value(f, itype)
    else:
        f.seek(struct.calcsize(_GGUF_SCALARS[vtype]), 1)


def gguf_tensors(path: Path) -> list[tuple[str, int, str]]:
    """``(name, n_elements, ggml type)`` of every tensor in a GGUF file (header only)."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        _, n_tensors, n_kv = _read(f, "I"), _read(f, "Q"), _read(f, "Q")
        for _ in range(n_kv):
            f.seek(_read(f, "Q"), 1)  # key
            _skip_value(f, _read(f, "I"))
        out = []
        for _ in range(n_tensors):
            name, n = f.read(_read(f, "Q")).decode(), 1
            for _ in range(_read(f, "I")):
                n *= _read(f, "Q")
            gtype, _offset = _read(f, "I"), _read(f, "Q")
            out.append((name, n, _GGML_TYPES.get(gtype, f"type{gtype}")))
    return out


def gguf_summary(path: Path) -> dict:
    """Size, parameter count, bits per weight (size * 8 / params) and tensors per type."""
    tensors = gguf_tensors(path)
    size, params = Path(path).stat().st_size, sum(n for _, n, _ in tensors)
    info = {"file": str(path), "bytes": size, "params": params, "bpw": size * 8 / params}
    return info | {"tensor_types": dict(Counter(t for _, _, t in tensors))}


# --- convert / quantize -------------------------------------------------------------------


def _gpt2_style(model_dir: Path) -> bool:
    """Whether the tokenizer's pre-tokenizer is GPT-2's (a lone ByteLevel with its regex)."""
    try:
        pre = json.loads((Path(model_dir) / "tokenizer.json").read_text())["pre_tokenizer"]
    except (OSError, ValueError, KeyError):
        return False
    return isinstance(pre, dict) and pre.get("type") == "ByteLevel" and pre.get("use_regex", True)


def _pydeps(python: str) -> Path:
    """``--target`` dir with sentencepiece (the converter imports it even for BPE vocabs)."""
    path = root_dir() / "pydeps"
    if not (path / ".warmboot-complete").exists():
        cmd = [python, "-m", "pip", "install", "--no-deps", "--target", str(path), SENTENCEPIECE]
        _run_logged("install converter deps", cmd, _log("build.log"))
        (path / ".warmboot-complete").write_text(SENTENCEPIECE + "\n")
    return path


def convert(model_dir: Path, out_path: Path, outtype: str = "bf16", python: str = "") -> Path:
    """HF checkpoint dir -> GGUF through the vendored ``convert_hf_to_gguf.py``.

    Runs with ``python`` (default: this interpreter, the project venv). An unknown BPE
    pre-tokenizer hash is mapped to GPT-2's only where the tokenizer's pre-tokenizer is
    GPT-2's ByteLevel (the demo tokenizer is); the hash is printed then.
    """
    if outtype not in CONVERT_TYPES:
        raise ValueError(f"outtype must be one of {CONVERT_TYPES}, got {outtype!r}")
    ensure_build()
    _patch_converter()
    out_path, python = Path(out_path), python or sys.executable
    out_path.parent.mkdir(parents=True, exist_ok=True)
    script = str(src_dir() / "convert_hf_to_gguf.py")
    cmd = [python, script, str(model_dir), "--outfile", str(out_path), "--outtype", outtype]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_pydeps(python)), env.get("PYTHONPATH")]))
    hashes, log = list(DEMO_TOKENIZER_HASHES), _log(f"convert-{out_path.stem}.log")
    log.write_text("")
    while True:
        env["WARMBOOT_GPT2_PRE_HASHES"] = ",".join(hashes)
        try:
            _run_logged(f"convert ({outtype})", cmd, log, env=env)
            return out_path
        except RuntimeError:
            found = re.findall(r"chkhsh:\s+([0-9a-f]{64})", log.read_text())
            if not found or found[-1] in hashes or not _gpt2_style(model_dir):
                raise
            print(f"[llama.cpp] unknown BPE hash {found[-1]}: mapped to gpt-2", flush=True)
            hashes.append(found[-1])


def quantize(gguf_in: Path, gguf_out: Path, qtype: str = "Q4_K_M", threads: int = 2) -> dict:
    """``llama-quantize gguf_in gguf_out qtype``; the summary plus the fallbacks it logged."""
    log = _log(f"quantize-{Path(gguf_out).stem}.log")
    log.write_text("")
    cmd = [str(tool("llama-quantize")), str(gguf_in), str(gguf_out), qtype, str(threads)]
    _run_logged(f"quantize ({qtype})", cmd, log)
    fallback = re.findall(r"(\d+) of (\d+) tensor\(s\) required fallback", log.read_text())
    n_fallback = "{} of {} tensors".format(*fallback[-1]) if fallback else "none"
    return {**gguf_summary(gguf_out), "qtype": qtype, "fallback": n_fallback}


# --- benchmarks ---------------------------------------------------------------------------

# our names -> llama-batched-bench's JSONL keys
_ROW = {"batch": "pl", "prompt_len": "pp", "new_tokens": "tg", "threads": "n_threads"}
_ROW |= {"prefill_tok_s": "speed_pp", "decode_tok_s": "speed_tg", "total_tok_s": "speed"}
_ROW |= {"prefill_s": "t_pp", "decode_s": "t_tg", "flash_attn": "flash_attn", "n_ctx": "n_kv_max"}


def batched_bench(gguf: Path, batches=(1, 8, 32), prompt_len=128, new_tokens=64, threads=2):
    """``llama-batched-bench`` (JSONL output): one row per batch size, one model load.

    Each of ``b`` sequences gets its own ``prompt_len`` random tokens (prefill of b * prompt_len
    tokens), then ``new_tokens`` decode steps of ``b`` tokens. ``decode_tok_s`` is b * new_tokens
    / decode time (steady state, after prefill), ``prefill_tok_s`` b * prompt_len / prefill time,
    ``total_tok_s`` all tokens / all time. The context is sized so every batch fits.
    """
    batches = [int(b) for b in batches]
    n_ctx = max(batches) * (prompt_len + new_tokens)
    cmd = [str(tool("llama-batched-bench")), "-m", str(gguf), "-c", str(n_ctx)]
    cmd += ["-npp", str(prompt_len), "-ntg", str(new_tokens), "-npl", ",".join(map(str, batches))]
    cmd += ["-t", str(threads), "-tb", str(threads), "--output-format", "jsonl"]
    out = _run(cmd).stdout
    rows = [json.loads(x) for x in out.splitlines() if x.startswith('{"n_kv_max"')]
    if sorted(r["pl"] for r in rows) != sorted(batches):
        raise RuntimeError(f"expected rows for batches {batches}, got:\n{out[-4000:]}")
    extra = {"command": " ".join(cmd), "llama_cpp_commit": build_info()["commit"]}
    extra["llama_cpp_version"] = version()
    return [{k: r[v] for k, v in _ROW.items()} | extra for r in rows]


def decode_tok_s(gguf: Path, batch: int, prompt_len=128, new_tokens=64, threads=2) -> dict:
    """Steady-state decode throughput (tokens/s summed over the batch) at one batch size."""
    return batched_bench(gguf, [batch], prompt_len, new_tokens, threads)[0]


def best_of(runs: list[dict]) -> list[dict]:
    """Per batch size, the run with the highest decode tok/s (over thread counts and repeats),
    with the best decode tok/s of each thread count beside it."""
    best = []
    for b in sorted({r["batch"] for r in runs}):
        mine = sorted((r for r in runs if r["batch"] == b), key=lambda r: r["decode_tok_s"])
        by_threads = {r["threads"]: r["decode_tok_s"] for r in mine}  # the best one wins
        best.append({**mine[-1], "runs": len(mine), "decode_tok_s_by_threads": by_threads})
    return best


def best_of_threads(gguf: Path, batches=(1, 8, 32), threads=(1, 2), repeats=1, **kw):
    """``best_of`` over ``repeats`` ``batched_bench`` runs per thread count ("best of 1 and 2")."""
    runs = [batched_bench(gguf, batches, threads=t, **kw) for t in threads for _ in range(repeats)]
    return best_of([r for rows in runs for r in rows])


def llama_bench(gguf: Path, prompt_len=128, new_tokens=64, threads=2, reps=3) -> dict:
    """Batch-1 prefill and decode tok/s (mean, stddev over ``reps``) from ``llama-bench -o json``."""
    cmd = [str(tool("llama-bench")), "-m", str(gguf), "-p", str(prompt_len), "-n", str(new_tokens)]
    cmd += ["-t", str(threads), "-r", str(reps), "-o", "json"]
    res = {"command": " ".join(cmd), "threads": threads}
    for r in json.loads(_run(cmd).stdout):
        key = "prefill" if r["n_prompt"] else "decode"
        res[f"{key}_tok_s"], res[f"{key}_tok_s_std"] = r["avg_ts"], r["stddev_ts"]
        res["llama_cpp_commit"], res["cpu_info"] = r.get("build_commit"), r.get("cpu_info")
    return res


# --- CLI ----------------------------------------------------------------------------------


def _gguf_for(model: Path, out_dir: Path, t: str) -> tuple[Path, dict]:
    """``bf16`` / ``f32`` / ``q8_0`` convert directly, others quantize the bf16 file; a GGUF
    newer than every file of the checkpoint is reused."""
    base, qtype = (t, None) if t.lower() in CONVERT_TYPES else ("bf16", t.upper())
    newest = max(f.stat().st_mtime for f in model.iterdir())
    gguf = out_dir / f"{model.name}-{base}.gguf"
    if not gguf.exists() or gguf.stat().st_mtime < newest:
        convert(model, gguf, base)
    if qtype is None:
        return gguf, gguf_summary(gguf)
    src, gguf = gguf, out_dir / f"{model.name}-{qtype}.gguf"
    if not gguf.exists() or gguf.stat().st_mtime < src.stat().st_mtime:
        return gguf, quantize(src, gguf, qtype)
    return gguf, gguf_summary(gguf)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True, help="HF checkpoint directory")
    p.add_argument("--types", default="bf16,q8_0,q4_k_m")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--threads", default="2", help="e.g. 1,2: one run each, plus the best per batch")
    p.add_argument("--repeats", type=int, default=1, help="runs per thread count (best kept)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--out-dir", type=Path, help="GGUF folder (default: <build root>/gguf/<model>)")
    a = p.parse_args(argv)
    out_dir = a.out_dir or root_dir() / "gguf" / a.model.name
    batches = [int(x) for x in a.batches.split(",")]
    kw = {"prompt_len": a.prompt_len, "new_tokens": a.new_tokens}
    print(json.dumps({"build": build_info(), "version": version()}), flush=True)
    for t in a.types.split(","):
        gguf, info = _gguf_for(a.model, out_dir, t)
        print(json.dumps({"type": t, "gguf": info}), flush=True)
        runs = []
        for n in [int(x) for x in a.threads.split(",")] * a.repeats:
            runs += batched_bench(gguf, batches, threads=n, **kw)
            for row in runs[-len(batches) :]:
                print(json.dumps({"type": t, **row}), flush=True)
        for row in best_of(runs) if len(runs) > len(batches) else []:
            print(json.dumps({"type": t, "best": True, **row}), flush=True)


if __name__ == "__main__":
    main()
