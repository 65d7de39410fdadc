"""Prometheus metrics: one registry per server (no process globals, so tests can run several).

Request counters and latency histograms are updated by the handlers; engine gauges (running,
waiting, KV usage, bubble fraction) are read from the engine at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ServerMetrics:
    def __init__(self, engine_state: Callable[[], dict | None]):
        """``engine_state()`` returns the engine's stats plus start facts, or None while booting."""
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "warmboot_requests",
            "Finished HTTP requests by endpoint and status code",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.finished = Counter(
            "warmboot_completions_finished",
            "Generated completions by finish reason",
            ["reason"],
            registry=self.registry,
        )
        self.aborted = Counter(
            "warmboot_requests_aborted",
            "Requests aborted because their client went away",
            registry=self.registry,
        )
        self.ttft = Histogram(
            "warmboot_time_to_first_token_seconds",
            "Time from request arrival to its first generated token",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "warmboot_inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "warmboot_request_latency_seconds",
            "Time from request arrival to its last token",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "warmboot_prompt_tokens", "Prompt tokens processed", registry=self.registry
        )
        self.generation_tokens = Counter(
            "warmboot_generation_tokens", "Tokens generated", registry=self.registry
        )
        self.admitted = Counter(
            "warmboot_requests_admitted", "API calls admitted", registry=self.registry
        )
        self.rejected = Counter(
            "warmboot_requests_rejected",
            "API calls refused at capacity (429), by the bound that was full",
            ["bound"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "warmboot_sequences_in_flight",
            "Sequences admitted and not yet finished (running or queued)",
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(engine_state))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    def __init__(self, engine_state: Callable[[], dict | None]):
        self._state = engine_state

    def describe(self):
        return []

    def collect(self):
        state = self._state()
        ready = GaugeMetricFamily("warmboot_ready", "1 when the engine serves requests")
        ready.add_metric([], 0.0 if state is None else 1.0)
        yield ready
        if state is None:
            return
        for name, key, doc in (
            ("warmboot_requests_running", "running", "Requests in the running batch"),
            ("warmboot_requests_waiting", "waiting", "Requests waiting to be scheduled"),
            ("warmboot_kv_cache_usage", "kv_usage", "Fraction of KV blocks in use"),
            ("warmboot_kv_blocks_used", "kv_blocks_used", "KV blocks in use"),
            ("warmboot_kv_blocks_capacity", "kv_blocks_total", "KV blocks in the pool"),
            ("warmboot_preemptions", "preemptions", "Requests preempted so far"),
            ("warmboot_express_steps", "express_steps", "Steps of new clients' prompts alone"),
            ("warmboot_shared_steps", "shared_steps", "Steps kept short as clients share"),
        ):
            gauge = GaugeMetricFamily(name, doc)
            gauge.add_metric([], float(state[key]))
            yield gauge
        bubble = GaugeMetricFamily(
            "warmboot_bubble_fraction", "Share of decode wall time the device sat idle"
        )
        bubble.add_metric([], float(state["bubble_fraction"] or 0.0))
        yield bubble
        graphs = InfoMetricFamily(
            "warmboot_cuda_graphs", "Decode CUDA graphs: on, off, or off with the capture's error"
        )
        graphs.add_metric([], {"state": str(state.get("cuda_graphs", "off"))})
        yield graphs
        graph_steps = CounterMetricFamily(
            "warmboot_graph_steps", "Decode steps replayed as CUDA graphs"
        )
        graph_steps.add_metric([], float(state.get("graph_steps") or 0))
        yield graph_steps
        yield from _memory_families(state)
        yield from _state_families(state)
        yield from _start_families(state)
        yield from _helper_families(state)


def _helper_families(state: dict):
    """CPU steps run with the native kernels' helper thread lent and solo (``device.helper_arms``
    chooses, step by step); absent where no helper is lent."""
    steps = state.get("helper_steps")
    if steps:
        family = CounterMetricFamily(
            "warmboot_cpu_helper_steps",
            "CPU model steps run solo or lent the helper thread, as measured faster",
            labels=["way"],
        )
        for way, count in zip(("solo", "lent"), steps, strict=True):
            family.add_metric([way], float(count))
        yield family


def _state_families(state: dict):
    """Models with state layers: state slots and the states kept for the prefix cache
    (``core.state_prefix``); absent for other models."""
    if not state.get("state_slots_total"):
        return
    gauges = {
        "state_slots_used": "Per-request state slots in use (live and still written by a step)",
        "state_slots_total": "Per-request state slots",
        "state_checkpoints_kept": "Request states kept at block boundaries for the prefix cache",
        "state_checkpoints_total": "Rows for states kept at block boundaries",
    }
    for key, doc in gauges.items():
        name = "warmboot_" + key.replace("_total", "_capacity")
        gauge = GaugeMetricFamily(name, doc)
        gauge.add_metric([], float(state.get(key, 0)))
        yield gauge
    hits = CounterMetricFamily(
        "warmboot_state_prefix_hits", "Requests that started from a kept state (prefix hit)"
    )
    hits.add_metric([], float(state.get("state_prefix_hits", 0)))
    yield hits


def _memory_families(state: dict):
    """What the bounded memory holders hold: the KV pool, the compiled-grammar cache. (An
    engine image from an older version lacks these keys: the families are then left out.)"""
    if "kv_cache_bytes" in state:
        pool = GaugeMetricFamily(
            "warmboot_kv_cache_bytes",
            "Bytes of the KV block pool (on CPU its pages become resident as blocks are first "
            "written, so RSS grows by up to this much under load)",
        )
        pool.add_metric([], float(state["kv_cache_bytes"]))
        yield pool
    grammar = state.get("grammar")
    if not grammar:
        return
    for name, key, doc in (
        (
            "warmboot_grammar_cache_bytes",
            "cached_bytes",
            "Bytes held by the compiled-grammar cache (xgrammar's count plus the spec text)",
        ),
        (
            "warmboot_grammar_cache_limit_bytes",
            "cache_limit_bytes",
            "The compiled-grammar cache's bound in bytes",
        ),
        ("warmboot_grammar_cache_entries", "cached_grammars", "Compiled grammars cached"),
    ):
        gauge = GaugeMetricFamily(name, doc)
        gauge.add_metric([], float(grammar[key]))
        yield gauge
    compiles = CounterMetricFamily(
        "warmboot_grammar_compiles",
        "Grammars asked for, by outcome: hit (already compiled), compiled or failed (a compile "
        "ran), timed_out (a caller stopped waiting), dropped (queued, then nobody waited)",
        labels=["outcome"],
    )
    for outcome, key in (
        ("hit", "hits"),
        ("compiled", "compiled"),
        ("failed", "failed"),
        ("timed_out", "timed_out"),
        ("dropped", "dropped"),
    ):
        compiles.add_metric([outcome], float(grammar.get(key, 0)))
    yield compiles


def _start_families(state: dict):
    """How this replica started: path, fallbacks, restarts, phase times, compiled graphs."""
    start = InfoMetricFamily("warmboot_start", "How this replica started and why")
    start.add_metric([], {"path": state["start_path"], "reason": state["start_reason"]})
    yield start
    fallbacks = CounterMetricFamily(
        "warmboot_start_fallbacks",
        "Start-up fallbacks of this replica by kind (a failed restore, a canary mismatch...)",
        labels=["kind"],
    )
    for kind in sorted(set(state["start_fallbacks"])):
        fallbacks.add_metric([kind], float(state["start_fallbacks"].count(kind)))
    yield fallbacks
    restarts = CounterMetricFamily(
        "warmboot_engine_restarts", "Engines rebooted after the previous one died"
    )
    restarts.add_metric([], float(state["engine_restarts"]))
    yield restarts
    ready_s = GaugeMetricFamily(
        "warmboot_time_to_ready_seconds",
        "Seconds from process start (a restart: from its start) to engine ready",
    )
    ready_s.add_metric([], float(state["time_to_ready_s"]))
    yield ready_s
    phases = GaugeMetricFamily(
        "warmboot_startup_phase_seconds", "Seconds per start-up phase", labels=["phase"]
    )
    for phase, seconds in state["startup_times"].items():
        phases.add_metric([phase], float(seconds))
    yield phases
    compile_info = state.get("compile") or {}
    graphs = GaugeMetricFamily(
        "warmboot_compile_graphs",
        "Model-step graphs compiled at start-up, by inductor cache outcome (miss: compiled)",
        labels=["cache"],
    )
    for outcome, key in (("hit", "cache_hits"), ("miss", "cache_misses")):
        graphs.add_metric([outcome], float(compile_info.get(key, 0)))
    yield graphs
    ready = GaugeMetricFamily(
        "warmboot_compiled_steps",
        "1 once the compiled model steps run (a restore compiles "
        "them in the background while eager steps serve)",
    )
    ready.add_metric([], 1.0 if compile_info.get("compiled") else 0.0)
    yield ready
