"""Issue 23's soak: is the server's memory flat under a long mixed workload, and what holds it.

A fresh ``warmboot serve`` (demo model, bf16, eager) gets a fill, then ``--minutes`` of a mixed
workload (the first ``--warmup-minutes`` the warm-up) at ``--rate`` requests/s, at most
``--max-in-flight`` at once: small and long completions, chats with tools, streams left after
3 events, bad requests, chats with a distinct JSON schema each. The fill sends distinct
``max_model_len``-token prompts until every KV block was written: on CPU the pool is an
anonymous mapping whose pages become resident as blocks are first written, and the block
manager takes never-used blocks before it evicts cached ones, so any load raises RSS by up to
the pool's size (``warmboot_kv_cache_bytes``), once. Sampled every ``--sample-s``: RSS of the
server and its children, the resident part of the pool's mapping (``/proc/PID/smaps``), the
grammar cache (``/metrics``). Bounded: a request gives up after 60 s, the fill after
``--fill-minutes``; a watchdog kills the server and exits past the sum plus 2 min.

    python -m bench.soak --minutes 30 [--warmup-minutes 5] [--rate 2] [--quick]

Writes ``docs/benchmarks/soak.{json,md,png}`` (``bench/soak_report.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import signal
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

from bench.common import OUT, report_meta, save_report
from bench.fairness import Warmboot
from bench.fairness_loads import chat, json_schema
from bench.rawhttp import dumps, exchange, post
from bench.soak_report import plot, report_lines, summary

LIMIT_S = 60.0
"""A request with no complete answer by then is abandoned."""
MODEL_ID = "soak"
KINDS = {"small": 30, "long": 10, "chat+tools": 20, "abandoned stream": 15, "bad": 15, "schema": 10}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": f"t{k}",
            "description": "a tool",
            "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
        },
    }
    for k in range(3)
]
GAUGES = {
    "kv_pool_mb": "warmboot_kv_cache_bytes",
    "grammar_mb": "warmboot_grammar_cache_bytes",
    "grammars": "warmboot_grammar_cache_entries",
}


class Server(Warmboot):
    """``warmboot serve`` in its own session, healthy; ``stop`` ends the whole group."""

    model_id = MODEL_ID

    def __init__(self, args):
        from warmboot.models.demo import ensure_default_model

        serve = argparse.Namespace(
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            eager=False,
            warmboot_args=args.serve_args,
        )
        super().__init__(args.model or ensure_default_model(), serve)
        self.start()


# --- what the server holds ---------------------------------------------------------------


def read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants (``/proc/PID/task/TID/children``)."""
    found, todo = [], [pid]
    while todo:
        found.append(p := todo.pop())
        for task in Path(f"/proc/{p}/task").glob("*"):
            todo += [int(c) for c in read(f"{task}/children").split()]
    return found


def rss_mb(pids: list[int]) -> float:
    kb = [re.search(r"^VmRSS:\s+(\d+)", read(f"/proc/{p}/status"), re.M) for p in pids]
    return round(sum(int(m.group(1)) for m in kb if m) / 1024, 1)


def kv_resident_mb(smaps: str, pool_bytes: float) -> float | None:
    """The resident MB of the KV pool in one ``smaps`` text: the smallest anonymous mapping at
    least the pool's size and under 5 % larger (the pool plus its scratch block)."""
    best = None
    for head, body in re.findall(
        r"^([0-9a-f]+-[0-9a-f]+ [^\n]*)\n((?:[A-Z]\w*:[^\n]*\n)+)", smaps, re.M
    ):
        fields = head.split()
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if len(fields) > 5 or not pool_bytes <= end - start <= pool_bytes * 1.05:
            continue
        if best is None or end - start < best[0]:
            best = (end - start, int(re.search(r"^Rss:\s+(\d+)", body, re.M).group(1)))
    return None if best is None else round(best[1] / 1024, 1)


def fetch(addr, path: str) -> str:
    try:
        with urllib.request.urlopen(f"http://{addr[0]}:{addr[1]}{path}", timeout=10) as r:
            return r.read().decode()
    except OSError:
        return ""


def scrape(addr) -> dict[str, float]:
    """The ``GAUGES`` from ``/metrics`` (MB for bytes); those missing are left out."""
    text, got = fetch(addr, "/metrics"), {}
    for key, name in GAUGES.items():
        if m := re.search(rf"^{name} (\S+)$", text, re.M):
            v = float(m.group(1))
            got[key] = round(v / 2**20, 3) if key.endswith("_mb") else int(v)
    return got


# --- the workload ------------------------------------------------------------------------


def request(kind: str, k: int) -> tuple[bytes, bytes, int]:
    """(head, body, SSE events to read before leaving: 0 = the whole answer) of the
    ``k``-th request, of ``kind``."""
    prompt = {"model": MODEL_ID, "prompt": f"the replicas boot and then they {k % 7}"}
    if kind in ("small", "long", "abandoned stream"):
        tokens, events = {"small": (4, 0), "long": (128, 0), "abandoned stream": (256, 3)}[kind]
        body = dumps(prompt | {"max_tokens": tokens, "ignore_eos": True, "stream": True})
        return post("/v1/completions", body), body, events
    if kind == "chat+tools":
        body = dumps(chat(MODEL_ID, max_tokens=16, tools=TOOLS, temperature=0.0))
        return post("/v1/chat/completions", body), body, 0
    if kind == "schema":
        props = {f"p{k}_{j}": {"type": "integer"} for j in range(4)}
        fmt = json_schema({"type": "object", "properties": props})
        body = dumps(chat(MODEL_ID, max_tokens=16, response_format=fmt))
        return post("/v1/chat/completions", body), body, 0
    bad = [
        b"{",
        dumps({"model": "nope", "prompt": "x"}),
        dumps(prompt | {"max_tokens": -5}),
        dumps({"model": MODEL_ID}),
    ]
    return post("/v1/completions", bad[k % len(bad)]), bad[k % len(bad)], 0


class Soak:
    """The phases against one server, its samples and its request counts."""

    def __init__(self, server: Server, args):
        self.server, self.args = server, args
        self.t0, self.phase = time.monotonic(), "start"
        self.samples: list[dict] = []
        self.counts: dict[str, Counter] = {}
        self.marks: dict[str, float] = {}
        self._lock, self._done = threading.Lock(), threading.Event()
        self._slots = threading.Semaphore(args.max_in_flight)
        self._rng, self._k = random.Random(1), 0

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 1)

    def count(self, kind: str, outcome: str) -> None:
        with self._lock:
            self.counts.setdefault(kind, Counter())[outcome] += 1

    def send(self, kind: str, req: tuple[bytes, bytes, int], slot: threading.Semaphore) -> None:
        """One request on its own thread, which releases ``slot`` once it is answered."""

        def run() -> None:
            try:
                ans = exchange(self.server.addr, req[0], req[1], LIMIT_S, max_events=req[2])
                self.count(kind, ans.key())
            finally:
                slot.release()

        threading.Thread(target=run, daemon=True).start()

    @staticmethod
    def drain(slot: threading.Semaphore, size: int) -> None:
        """Wait (at most ``LIMIT_S``) for the requests holding ``slot``'s ``size`` places."""
        end = time.monotonic() + LIMIT_S + 5
        taken = sum(slot.acquire(timeout=max(0.0, end - time.monotonic())) for _ in range(size))
        for _ in range(taken):
            slot.release()

    def sample(self) -> dict:
        pids = tree(self.server.proc.pid)
        row = {"t": self.now(), "phase": self.phase, "rss_mb": rss_mb(pids)}
        row |= scrape(self.server.addr)
        if "kv_pool_mb" in row:
            kv = [kv_resident_mb(read(f"/proc/{p}/smaps"), row["kv_pool_mb"] * 2**20) for p in pids]
            row["kv_mb"] = sum(v for v in kv if v is not None)
        return row

    def sampler(self) -> None:
        while True:
            self.samples.append(self.sample())
            if self._done.wait(self.args.sample_s):
                self.samples.append(self.sample())
                return

    def fill(self) -> None:
        """Distinct prompts of ``max_model_len`` random ids, 2 at a time, until the KV pool's
        mapping is resident (none where it is not found: a GPU, an older server)."""
        self.phase, rng, slot = "fill", random.Random(0), threading.Semaphore(2)
        vocab = min(
            json.loads(fetch(self.server.addr, "/tokenizer_info") or "{}").get("vocab_size", 1000),
            32000,
        )
        deadline = time.monotonic() + self.args.fill_minutes * 60
        while time.monotonic() < deadline and self.server.proc.poll() is None:
            last = self.samples[-1] if self.samples else {}
            if not last.get("kv_mb") or last["kv_mb"] >= 0.99 * last["kv_pool_mb"]:
                break
            if slot.acquire(timeout=1.0):
                ids = [rng.randrange(256, vocab) for _ in range(self.args.max_model_len - 8)]
                body = dumps({"model": MODEL_ID, "prompt": ids, "max_tokens": 1})
                self.send("fill", (post("/v1/completions", body), body, 0), slot)
        self.drain(slot, 2)
        self.samples.append(self.sample())

    def mix(self, until_s: float) -> None:
        """The mixed workload at ``--rate`` until ``until_s`` (seconds since the start)."""
        start, sent = time.monotonic(), 0
        while self.now() < until_s and self.server.proc.poll() is None:
            kind = self._rng.choices(list(KINDS), list(KINDS.values()))[0]
            if self._slots.acquire(blocking=False):
                self.send(kind, request(kind, self._k), self._slots)
            else:
                self.count(kind, "skipped (in-flight cap)")
            self._k, sent = self._k + 1, sent + 1
            time.sleep(max(0.0, start + sent / self.args.rate - time.monotonic()))

    def run(self) -> None:
        """Fill, warm up, soak: ``--minutes`` of the mixed workload in all."""
        sampler = threading.Thread(target=self.sampler, daemon=True)
        sampler.start()
        try:
            time.sleep(1.0)  # NOTE: the first sample, with the pool's size
            if not self.args.no_fill:
                self.fill()
            start = self.marks["fill_end_s"] = self.now()
            self.phase = "warm-up"
            self.mix(start + self.args.warmup_minutes * 60)
            self.marks["warm_end_s"], self.phase = self.now(), "soak"
            self.mix(start + self.args.minutes * 60)
            self.drain(self._slots, self.args.max_in_flight)
        finally:
            self._done.set()
            sampler.join(30)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = ap.add_argument
    add("--minutes", type=float, default=30.0, help="the mixed workload, warm-up included")
    add("--warmup-minutes", type=float, default=5.0)
    add("--fill-minutes", type=float, default=10.0, help="the fill's bound")
    add("--no-fill", action="store_true", help="no fill: the pool fills under the mix")
    add("--rate", type=float, default=2.0, help="requests per second")
    add("--max-in-flight", type=int, default=16)
    add("--sample-s", type=float, default=10.0)
    add("--model", type=Path, default=None, help="default: the demo model")
    add("--dtype", default="bfloat16")
    add("--max-model-len", type=int, default=2048)
    add("--serve-args", default="", help="more `warmboot serve` flags")
    add("--quick", action="store_true", help="a smoke run: 1 min, no fill, written to /tmp")
    add("--out", type=Path, default=None, help=f"default: {OUT}")
    args = ap.parse_args()
    if args.quick:
        args.minutes, args.warmup_minutes, args.no_fill, args.sample_s = 1.0, 0.25, True, 5.0
    args.out = args.out or (Path("/tmp/bench-soak-quick") if args.quick else OUT)
    run(args)


def run(args) -> dict:
    server = Server(args)
    budget_s = (args.fill_minutes * (not args.no_fill) + args.minutes + 2) * 60

    def expire() -> None:  # NOTE: a run past its bound: the server goes, then this process
        os.killpg(server.proc.pid, signal.SIGKILL)
        os._exit(3)

    watchdog = threading.Timer(budget_s, expire)
    watchdog.daemon = True
    watchdog.start()
    try:
        soak = Soak(server, args)
        soak.run()
        alive = server.proc.poll() is None
    finally:
        watchdog.cancel()
        server.stop()
    res = summary(soak.samples, soak.marks, soak.counts) | {"server_survived": alive}
    meta = report_meta(
        command="python -m bench.soak " + shlex.join(sys.argv[1:]),
        mix=KINDS,
        server=shlex.join(["warmboot", *server.cmd[3:]]),
        args={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    )
    save_report(args.out, "soak", meta, res, report_lines(meta, res), plot(meta, res))
    return res


if __name__ == "__main__":
    main()
