"""``warmboot demo``: the product's point on the built-in model, in one table.

A first start boots cold (in gVisor when ``runsc`` is there) and publishes a snapshot into a
fresh store; a second start restores from it. Each start's phases and time to ready are shown
side by side, and both answer the same prompts, greedily, to show they agree.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from pathlib import Path

from warmboot.launcher.launch import LaunchConfig, launch
from warmboot.sampling_params import SamplingParams

PROMPTS = [
    "The quick brown fox",
    "Serverless GPUs start cold, so",
    "A recipe for bread needs flour, water and",
    "In 1969 the first",
    "Le café du coin sert",
    "def fibonacci(n):",
    "The capital of France is",
    "Once upon a time, in a small village,",
]


def run_demo(engine: dict, sandbox: str, max_tokens: int) -> int:
    from rich.console import Console

    console = Console()
    root = Path(tempfile.mkdtemp(prefix="warmboot-demo-"))
    store = root / "store"
    engine = {**engine, "snapshot_store": str(store)}
    cfg = LaunchConfig(engine=engine, store=str(store), sandbox=sandbox, work_dir=root / "work")
    starts = []
    try:
        for label in ("first start", "second start"):
            console.print(f"[bold]{label}[/bold]: starting the engine ...")
            starts.append(_one_start(cfg, label, max_tokens))
            s = starts[-1]
            console.print(
                f"  {s['path']} in {s['ready_s']:.2f}s ({s['reason']}); "
                f"{s['tok_s']:.1f} output tokens/s, decode loop {s['loop']}"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    _show(console, starts)
    return 0 if starts[0]["texts"] == starts[1]["texts"] else 1


def _one_start(cfg: LaunchConfig, label: str, max_tokens: int) -> dict:
    t0 = time.monotonic()
    client = launch(cfg)
    ready = time.monotonic() - t0
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        outs = asyncio.run(_generate(client, params))
        elapsed = time.perf_counter() - t0
        stats = client.stats()
    finally:
        client.shutdown()
    info = client.start_info
    return {
        "label": label,
        "path": info.path,
        "reason": info.reason,
        "ready_s": ready,
        "phases": dict(info.phase_times),
        "texts": [o.outputs[0].text for o in outs],
        "tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / elapsed,
        "loop": stats.get("loop", "?"),
    }


async def _generate(client, params: SamplingParams):
    async def one(prompt: str):
        stream = await client.add_request(prompt, params)
        return [o async for o in stream][-1]

    return await asyncio.gather(*(one(p) for p in PROMPTS))


def _show(console, starts: list[dict]) -> None:
    from rich.table import Table

    table = Table(title="cold boot vs restore (seconds)")
    table.add_column("phase")
    for s in starts:
        table.add_column(f"{s['label']}: {s['path']}", justify="right")
    names = list(dict.fromkeys(name for s in starts for name in s["phases"]))
    for name in names:
        table.add_row(name, *(_sec(s["phases"].get(name)) for s in starts))
    table.add_row(
        "[bold]time to ready[/bold]", *(f"[bold]{s['ready_s']:.2f}[/bold]" for s in starts)
    )
    table.add_row("output tokens/s", *(f"{s['tok_s']:.1f}" for s in starts))
    console.print(table)
    a, b = starts
    console.print(
        f"restore took {b['ready_s'] / a['ready_s']:.0%} of the first start's time to ready; "
        f"same answers to all {len(PROMPTS)} prompts: "
        f"{'yes' if a['texts'] == b['texts'] else '[red]NO[/red]'}"
    )
    for prompt, text in list(zip(PROMPTS, b["texts"], strict=True))[:3]:
        console.print(f"  [bold]{prompt!r}[/bold] -> {text[:70]!r}")


def _sec(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"
