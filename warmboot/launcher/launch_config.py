"""What ``launch`` is told (``LaunchConfig``): the engine's settings, the store, where the
engine runs (the ``sandbox`` and ``engine_process`` settings, ``serve``'s options) and the
start-up's callbacks. Light to import: the command line reads its settings."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from warmboot.options import setting


@dataclass(frozen=True)
class LaunchConfig:
    engine: dict
    """``LLM`` keyword arguments (``model`` included; ``snapshot_store`` for tier A)."""
    store: str | None = None
    """Where process images live (the tier-A store); None disables tier P."""
    sandbox: str = setting(
        "auto",
        "auto: with a snapshot store and runsc, run the engine in a gVisor worker and restore "
        "it from a process snapshot; runsc: the same, saying loudly when runsc is missing; "
        "none: never gVisor",
        choices=("auto", "runsc", "none"),
    )
    work_dir: Path = field(default_factory=lambda: Path("/tmp/warmboot-launcher"))
    seed: int = 0
    boot_timeout: float = 600.0
    restore_timeout: float = 120.0
    """A restore (to a started, canary-checked worker) that takes longer falls back."""
    publish: bool = True
    engine_process: str = setting(
        "off",
        "the engine out of gVisor: on: in a child process, so the HTTP front end never slows "
        "its steps (and keeps off its cores); off: in this process; auto: on when it runs on "
        "the CPU",
        choices=("auto", "on", "off"),
    )
    engine_cpus: tuple[int, ...] | None = None
    """The CPUs an engine process may use (None: the launching thread's)."""
    place_front: bool = False
    """With an engine process on the CPU, move this process's threads off the cores the
    engine computes on (``serve``: this process is then only the HTTP front end)."""
    on_path: Callable[[bool], None] | None = None
    """Called once the start path is under way (a restore or boot launched), maybe again on a
    fallback, with whether the engine runs in gVisor: ``serve`` imports its HTTP stack only
    then, not beside the launcher's choice, and keeps where it ran (``spare_hints``)."""
    on_recorded: Callable[[bool], None] | None = None
    """Called once this start's cost is on record, with whether the next start of its key
    will run the engine in gVisor by the figures now on record (``local.recorded``): what
    ``serve`` keeps for its next spare, rather than where this one ran."""
