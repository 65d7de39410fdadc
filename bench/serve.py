"""Serving under load: warmboot's server (pipelined loop, and ``--sync``) against
``transformers serve``, same model, same run.

Each server runs as its own process on 127.0.0.1; a closed-loop load generator keeps
``concurrency`` streaming completions in flight (same prompts, greedy, fixed output length)
and measures requests/s, output tokens/s, time to first token and inter-token latency
(p50 / p99) per concurrency. The sync server shows what the pipelined loop changes under
load, time to first token included (a new prefill must not wait behind decodes). All servers
compute in float32 (the CPU default of warmboot; ``--dtype float32`` for transformers).
Writes ``docs/benchmarks/serve.{json,md,png}``; the notes under the tables are written by
hand after a run.

    python -m bench.serve [--model DIR] [--concurrency 1 8 32] [--max-tokens 32]
                          [--servers warmboot warmboot-sync transformers] [--offline]

``warmboot-inproc`` and ``warmboot-process`` pin where the engine runs (``--engine-process
off`` / ``on``); ``--offline`` also times a decode step of ``LLM`` itself (batch 1), the
floor a served stream's inter-token latency is compared with.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.common import OUT, machine, pyplot, report_meta, save_figure, write_json, write_page
from bench.servers import HOST, free_port, serve_cmd, stop_group, wait_healthy
from bench.timing import quantile

WORDS = "the quick brown fox jumps over a lazy dog while serverless replicas boot".split()


class Server:
    """A server process; ``model_id`` is what requests must name."""

    def __init__(self, name: str, cmd: list[str], port: int, model_id: str, extra: dict):
        self.name, self.cmd, self.port, self.model_id, self.extra = name, cmd, port, model_id, extra
        self.url = f"http://{HOST}:{port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Server:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
        self.log = open(f"/tmp/bench-serve-{self.name}.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            self.cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            self.ready_s = wait_healthy(self.proc, self.url, timeout_s=300)
        except RuntimeError as e:
            raise RuntimeError(f"{self.name}: {e}; see {self.log.name}") from None
        return self

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            stop_group(self.proc, grace_s=20)
        self.log.close()


def prompts(count: int) -> list[str]:
    return [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(6 + i % 5)) for i in range(count)]


async def one_request(client: httpx.AsyncClient, server: Server, prompt: str, max_tokens: int):
    body = {
        "model": server.model_id,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **server.extra,
    }
    t0 = time.perf_counter()
    stamps, usage = [], None
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                stamps.append(time.perf_counter())
    tokens = usage["completion_tokens"] if usage else len(stamps)
    return {"t0": t0, "stamps": stamps, "tokens": tokens, "end": time.perf_counter()}


async def load(server: Server, concurrency: int, requests: int, max_tokens: int) -> dict:
    todo = list(reversed(prompts(requests)))
    done: list[dict] = []
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=600) as client:

        async def worker():
            while todo:
                done.append(await one_request(client, server, todo.pop(), max_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    ttft = [r["stamps"][0] - r["t0"] for r in done if r["stamps"]]
    itl = [
        (r["stamps"][-1] - r["stamps"][0]) / (r["tokens"] - 1)
        for r in done
        if len(r["stamps"]) > 1 and r["tokens"] > 1
    ]
    tokens = sum(r["tokens"] for r in done)
    return {
        "server": server.name,
        "concurrency": concurrency,
        "requests": len(done),
        "wall_s": wall,
        "req_per_s": len(done) / wall,
        "out_tok_per_s": tokens / wall,
        "ttft_p50_ms": 1e3 * quantile(ttft, 50),
        "ttft_p99_ms": 1e3 * quantile(ttft, 99),
        "itl_p50_ms": 1e3 * quantile(itl, 50),
        "itl_p99_ms": 1e3 * quantile(itl, 99),
        "mean_tokens": tokens / len(done),
    }


SERVERS = ("warmboot", "warmboot-sync", "warmboot-inproc", "warmboot-process", "transformers")
DEFAULT_SERVERS = ["warmboot", "warmboot-sync", "transformers"]


def servers(model: str, names: list[str]) -> list[Server]:
    py = sys.executable

    def warmboot(name: str, extra: list[str]) -> Server:
        port = free_port()
        cmd = serve_cmd(model, port, "--served-model-name", "bench", "--dtype", "float32", *extra)
        return Server(name, cmd, port, "bench", {"ignore_eos": True})

    hf_port = free_port()
    hf = Server(
        "transformers",
        [str(Path(py).parent / "transformers"), "serve", model, "--port", str(hf_port)]
        + ["--host", "127.0.0.1", "--dtype", "float32", "--continuous-batching"]
        + ["--log-level", "warning"],
        hf_port,
        model,
        {},
    )
    made = {
        "warmboot": lambda: warmboot("warmboot", []),
        "warmboot-sync": lambda: warmboot("warmboot-sync", ["--sync"]),
        "warmboot-inproc": lambda: warmboot("warmboot-inproc", ["--engine-process", "off"]),
        "warmboot-process": lambda: warmboot("warmboot-process", ["--engine-process", "on"]),
        "transformers": lambda: hf,
    }
    return [made[n]() for n in names]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="model directory (default: built-in)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=DEFAULT_SERVERS)
    parser.add_argument("--offline", action="store_true", help="time LLM's own decode step too")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if args.model is None:
        from warmboot.models.demo import ensure_default_model

        args.model = str(ensure_default_model())
    offline = offline_step_ms(args.model) if args.offline else None
    if offline is not None:
        print(json.dumps({"offline_step_ms": round(offline, 3)}))
    rows, ready = [], {}
    for server in servers(args.model, args.servers):
        with server:
            ready[server.name] = server.ready_s
            asyncio.run(load(server, 1, 2, 4))  # warm-up: first-request compile / allocation
            for c in args.concurrency:
                row = asyncio.run(load(server, c, max(2 * c, 8), args.max_tokens))
                rows.append(row)
                print(
                    json.dumps(
                        {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}
                    )
                )
    if offline is not None:
        for row in rows:
            if row["concurrency"] == 1:
                ratio = row["itl_p50_ms"] / offline
                print(f"{row['server']}: ITL p50 at concurrency 1 / offline step = {ratio:.2f}")
    write_report(args, rows, ready, offline)


def offline_step_ms(model: str, tokens: int = 64) -> float:
    """``LLM.generate``'s decode step at batch 1, float32 (as the servers): the time of a
    ``tokens + 1``-token generation less a 1-token one, per token; best of three."""
    from warmboot import LLM, SamplingParams

    llm = LLM(model, dtype="float32")
    prompt = prompts(1)[0]

    def run(n: int) -> float:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(prompt, params)
        return time.perf_counter() - t0

    run(tokens + 1)  # warm-up
    best = min(run(tokens + 1) - run(1) for _ in range(3))
    llm.close()
    return 1e3 * best / tokens


def write_report(args, rows: list[dict], ready: dict, offline: float | None = None) -> None:
    import transformers

    meta = report_meta(
        machine=machine(),
        model=Path(args.model).name,
        max_tokens=args.max_tokens,
        transformers=transformers.__version__,
        time_to_healthy_s=ready,
        offline_step_ms=offline,
    )
    write_json(args.out / "serve.json", {"meta": meta, "rows": rows})
    by = {(r["server"], r["concurrency"]): r for r in rows}
    lines = [
        "# Serving under load: warmboot vs `transformers serve`",
        "",
        f"{meta['date']} · {meta['machine']} · model `{meta['model']}` (float32 on the CPU) · "
        f"{args.max_tokens} output tokens per request, greedy · transformers "
        f"{meta['transformers']} with `--continuous-batching` · made by `python -m bench.serve`.",
        "",
        "| concurrency | server | req/s | out tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms "
        "| tok/s vs transformers |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for c in args.concurrency:
        base = by.get(("transformers", c))
        for name in SERVERS:
            r = by.get((name, c))
            if r is None:
                continue
            ratio = r["out_tok_per_s"] / base["out_tok_per_s"] if base else float("nan")
            lines.append(
                f"| {c} | {name} | {r['req_per_s']:.2f} | {r['out_tok_per_s']:.1f} | "
                f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
                f"{r['itl_p50_ms']:.0f} / {r['itl_p99_ms']:.0f} | {ratio:.2f}× |"
            )
    if any(("warmboot-sync", c) in by and ("warmboot", c) in by for c in args.concurrency):
        lines += [
            "",
            "Pipelined loop against the sync loop (`--sync`), same load: ratios pipelined / sync"
            " (tok/s above 1 is faster; TTFT and ITL below 1 are shorter).",
            "",
            "| concurrency | out tok/s | TTFT p50 | TTFT p99 | ITL p50 |",
            "| ---: | ---: | ---: | ---: | ---: |",
        ]
        for c in args.concurrency:
            pipe, sync = by.get(("warmboot", c)), by.get(("warmboot-sync", c))
            if pipe and sync:
                q = {k: pipe[k] / sync[k] for k in pipe if k.endswith(("_s", "_ms"))}
                lines.append(
                    f"| {c} | {q['out_tok_per_s']:.2f} | {q['ttft_p50_ms']:.2f} |"
                    f" {q['ttft_p99_ms']:.2f} | {q['itl_p50_ms']:.2f} |"
                )
    lines += [
        "",
        "Time from process start to a healthy `/health`: "
        + ", ".join(f"{k} {v:.1f} s" for k, v in ready.items())
        + ".",
        "",
        "![serving](serve.png)",
        "",
    ]
    write_page(args.out / "serve.md", lines, meta, end="")
    plot(args, by)


def plot(args, by: dict) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    colors = {
        "warmboot": "tab:blue",
        "warmboot-sync": "tab:cyan",
        "warmboot-inproc": "tab:green",
        "warmboot-process": "tab:red",
        "transformers": "tab:gray",
    }
    for name, color in colors.items():
        cs = [c for c in args.concurrency if (name, c) in by]
        axes[0].plot(cs, [by[(name, c)]["out_tok_per_s"] for c in cs], "o-", c=color, label=name)
        axes[1].plot(cs, [by[(name, c)]["ttft_p50_ms"] for c in cs], "o-", c=color, label=name)
        axes[2].plot(cs, [by[(name, c)]["itl_p50_ms"] for c in cs], "o-", c=color, label=name)
    titles = ("output tokens/s", "TTFT p50 (ms)", "inter-token latency p50 (ms)")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_title(title)
        ax.legend()
    fig.suptitle(f"serving, {Path(args.model).name}, {datetime.date.today().isoformat()}")
    save_figure(fig, args.out / "serve.png", dpi=110)


if __name__ == "__main__":
    main()
