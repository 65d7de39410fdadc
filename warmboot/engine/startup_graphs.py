"""The CUDA-graph phases of start-up and of the idle engine (``Startup`` inherits them)."""

from __future__ import annotations

import logging
from typing import Any

from warmboot.device.graphs import default_batch_sizes

BootingEngine = Any
"""``engine.startup.BootingEngine`` (not imported: that module imports this one)."""

log = logging.getLogger("warmboot.startup")


class GraphPhases:
    graphs_note: str

    def enable_graphs(
        self, engine: BootingEngine, batch_sizes: tuple[int, ...] | None, emulate: bool
    ) -> None:
        if engine.has_unfinished_requests():
            raise RuntimeError("enable_decode_graphs needs an idle engine")
        sizes = batch_sizes or default_batch_sizes(engine.sched_config.max_num_seqs)
        engine.runner.setup_decode_graphs(sizes, emulate)
        self.graphs_note = "emulated" if emulate else "on"

    def capture_graphs(self, engine: BootingEngine, required: bool) -> None:
        """Capture at start-up. A capture that fails runs decode eagerly (with the reason in
        the log and ``stats()``) unless graphs were asked for explicitly."""
        reason = None
        if engine.runner.inputs.lora is not None:
            reason = "LoRA: a step's adapter rows are planned on the host"
        elif not engine.runner.model.graph_safe():
            reason = "the expert step reads its per-expert token counts on the host (MoE)"
        if reason is not None:
            if required:
                raise ValueError(f"CUDA graphs cannot capture this model: {reason}")
            engine.runner.graphs = None
            self.graphs_note = f"off: {reason}"
            log.info("CUDA graphs off: %s", reason)
            return
        try:
            self.enable_graphs(engine, None, emulate=False)
        except Exception as e:
            if required:
                raise
            engine.runner.graphs = None
            self.graphs_note = f"off: capture failed: {type(e).__name__}: {e}"
            log.warning("CUDA graph capture failed, decode runs eagerly: %s", e)

    def recapture_graphs(self, engine: BootingEngine) -> None:
        """Captured graphs hold the old weights' and KV pool's addresses: capture anew."""
        graphs = engine.runner.graphs
        if graphs is not None:
            self.enable_graphs(engine, graphs.batch_sizes, graphs.emulate)
