"""bench/soak.py's parts that need no model server: the KV pool found in ``smaps``, this
process's RSS and children, the requests, the slope and the summary."""

from __future__ import annotations

import json
import os

from bench import soak
from bench.soak_report import report_lines, slope, summary

MIB = 1 << 20


def mapping(start: int, size: int, rss_kb: int, name: str = "") -> str:
    head = f"{start:x}-{start + size:x} rw-p 00000000 00:00 0"
    return f"{head} {name}\nSize: {size >> 10} kB\nRss: {rss_kb} kB\nVmFlags: rd wr mr\n"


def test_kv_pool_is_the_anonymous_mapping_of_its_size():
    pool = 512 * MIB
    text = (
        mapping(0x1000_0000, 64 * MIB, 60_000)  # an arena: too small
        + mapping(0x2000_0000, pool + 2 * MIB, 300 * 1024)  # the pool and its scratch block
        + mapping(0x6000_0000, pool + 2 * MIB, 999, "/models/weights.safetensors")  # a file
        + mapping(0xA000_0000, 2 * pool, 1024)  # far larger
    )
    assert soak.kv_resident_mb(text, pool) == 300.0
    assert soak.kv_resident_mb(text, 4 * pool) is None


def test_rss_and_tree_of_this_process():
    assert os.getpid() in soak.tree(os.getpid())
    assert soak.rss_mb([os.getpid()]) > 10


def test_requests_are_json_and_schemas_distinct():
    kinds = [soak.request(kind, k) for k in range(8) for kind in soak.KINDS]
    for head, _, events in kinds:
        assert head.startswith(b"POST /v1/") and events in (0, 3)
    bodies = [json.loads(b) for _, b, _ in kinds if b"response_format" in b]
    assert len({json.dumps(b["response_format"]) for b in bodies}) == len(bodies) == 8


def test_summary_slopes_points_and_report():
    samples = [
        {"t": t, "rss_mb": 700 + min(t, 120) * 4, "kv_mb": min(t, 120) * 4, "grammars": 1}
        for t in range(0, 600, 10)
    ]
    assert slope([(0, 1.0), (60, 3.0), (120, 5.0)]) == 2.0
    res = summary(samples, {"fill_end_s": 120, "warm_end_s": 300}, {"small": {"200": 3}})
    assert res["slope_mb_per_min"] == res["rest_slope_mb_per_min"] == 0.0
    assert res["points"]["after fill"]["rss_mb"] == 1180 and res["points"]["end"]["rest_mb"] == 700
    meta = {
        "args": {
            "minutes": 5,
            "max_model_len": 2048,
            "rate": 2,
            "max_in_flight": 16,
            "sample_s": 10,
        },
        "machine": "m",
        "date": "d",
        "command": "c",
        "server": "s",
        "mix": soak.KINDS,
    }
    text = "\n".join(report_lines(meta, res | {"server_survived": True}))
    assert "RSS slope **0.0 MB/min**" in text and "small: 200 x3" in text
