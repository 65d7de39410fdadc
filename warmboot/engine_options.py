"""The engine's settings on a command line (``generate``, ``serve``, ``demo``, ``snapshot
create``, ``fleet``): ``EngineConfig``'s options, and the ``LLM`` keyword arguments a command
line gave. Torch-free, so registering a parser stays quick."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from warmboot.config import ENGINE_OPTIONS
from warmboot.options import add_options, given


def add_engine_options(
    p: argparse.ArgumentParser,
    defaults: Mapping[str, Any] = {},
    leave_out: tuple[str, ...] = (),
    verbose: bool = True,
) -> None:
    """The engine's settings (``EngineConfig``'s, as ``LLM``'s keyword arguments), but those
    in ``leave_out`` (a command's own spelling of them), and ``-v`` unless told not to."""
    add_options(p, [o for o in ENGINE_OPTIONS if o.name not in leave_out], defaults)
    if not verbose:
        return
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="log more: every warmboot INFO line (serve shows its start-up phases without -v)",
    )


def engine_kwargs(
    args: argparse.Namespace, model: str | None = None, leave_out: tuple[str, ...] = ()
) -> dict[str, Any]:
    """``LLM`` keyword arguments from a command line: the engine settings it set to other
    than their defaults (but ``leave_out``: the command's own), and ``model`` when given
    (plain JSON data: a worker gets them)."""
    settings = given(args, [o for o in ENGINE_OPTIONS if o.name not in leave_out])
    return ({} if model is None else {"model": model}) | settings
