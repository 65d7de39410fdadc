"""The native library's first build on a fresh machine, as a harness that restarts short-lived
engine processes sees it: ``--processes`` processes started ``--interval`` seconds apart on an
empty ``$WARMBOOT_CACHE``, each asking for the library (``native.ready()``, as an engine's first
step does) and exiting ``--lifetime`` seconds later, long before a build could end. Sampled
every 0.2 s until the library lands: compilers running (``cc1plus``), the machine's available
memory; then whether any compiler outlived the build, and how long a process that starts now
takes to load the library. Writes ``docs/benchmarks/native_build.{json,md,png}``.

Run it on a quiet machine: every ``cc1plus`` on it is counted.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import OUT, pyplot, report_meta, save_report

CHILD = (
    "import time; t0 = time.perf_counter(); from warmboot.kernels import native\n"
    "native.ready(); time.sleep({lifetime}); print(time.perf_counter() - t0)"
)


def compilers() -> int:
    count = 0
    for comm in Path("/proc").glob("[0-9]*/comm"):
        try:
            count += comm.read_text().strip() == "cc1plus"
        except OSError:
            continue
    return count


def available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--processes", type=int, default=6)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--lifetime", type=float, default=3.0)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    cache = Path(tempfile.mkdtemp(prefix="wb-native-bench-"))
    env = {**os.environ, "WARMBOOT_CACHE": str(cache)}
    code = CHILD.format(lifetime=args.lifetime)
    t0, procs, samples, started = time.perf_counter(), [], [], 0
    library = None
    while library is None:
        now = time.perf_counter() - t0
        if started < args.processes and now >= started * args.interval:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True
                )
            )
            started += 1
        alive = sum(p.poll() is None for p in procs)
        samples.append(
            {
                "t": now,
                "compilers": compilers(),
                "processes": alive,
                "available_gib": available_gib(),
            }
        )
        found = list(cache.glob("native/*/*/warmboot_native.so"))
        library = found[0] if found else None
        time.sleep(0.2)
    built_s = time.perf_counter() - t0
    lived = [float(p.communicate()[0].strip() or "nan") for p in procs]
    time.sleep(1.0)
    left = compilers()
    t1 = time.perf_counter()
    load = subprocess.run(
        [sys.executable, "-c", "from warmboot.kernels import native as n; print(n.library())"],
        env=env,
        capture_output=True,
        text=True,
    )
    load_s = time.perf_counter() - t1
    objects = len(list(cache.glob("native/*/*/objects/*.o")))
    row = {
        "processes": args.processes,
        "interval_s": args.interval,
        "lifetime_s": args.lifetime,
        "library_s": built_s,
        "process_lifetimes_s": lived,
        "max_compilers": max(s["compilers"] for s in samples),
        "min_available_gib": min(s["available_gib"] for s in samples),
        "start_available_gib": samples[0]["available_gib"],
        "compilers_after": left,
        "next_process_load_s": load_s,
        "loaded": load.stdout.strip().startswith(str(cache)),
        "objects_left": objects,
        "cpus": os.cpu_count(),
    }
    write_report(args, row, samples)


def write_report(args, row: dict, samples: list[dict]) -> None:
    meta = report_meta()
    lines = [
        "# Native library: the first build under short-lived processes",
        "",
        f"{meta['date']} · {meta['machine']} · {row['processes']} processes on an empty cache, "
        f"started {row['interval_s']:g} s apart, each exiting {row['lifetime_s']:g} s after its "
        "start (imports included) · `python -m bench.native_build`",
        "",
        "| what | figure |",
        "| :--- | ---: |",
        f"| first process start to the library in the cache | {row['library_s']:.1f} s |",
        f"| processes' lifetimes | {min(row['process_lifetimes_s']):.1f}-"
        f"{max(row['process_lifetimes_s']):.1f} s |",
        f"| compilers at once, most | {row['max_compilers']} |",
        f"| available memory: at start, lowest | {row['start_available_gib']:.1f}, "
        f"{row['min_available_gib']:.1f} GiB |",
        f"| compilers running 1 s after the library landed | {row['compilers_after']} |",
        f"| a process started then: loads the library in | {row['next_process_load_s']:.1f} s "
        f"({'loaded' if row['loaded'] else 'NOT loaded'}) |",
    ]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ts = [s["t"] for s in samples]
    ax.step(ts, [s["compilers"] for s in samples], where="post", label="compilers (cc1plus)")
    ax.step(ts, [s["processes"] for s in samples], where="post", label="engine processes alive")
    ax.set(
        xlabel="seconds from the first process's start",
        ylabel="count",
        title="first build of the native library",
    )
    ax.legend()
    save_report(args.out, "native_build", meta, [row | {"samples": samples}], lines, fig)


if __name__ == "__main__":
    main()
