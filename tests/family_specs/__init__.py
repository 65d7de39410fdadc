"""Tiny checkpoint specs of the families beyond the original four, one module per family
file of ``warmboot.models``: each defines ``SPECS = {kind: (config class, kwargs)}``.

Settings are chosen to exercise what the family adds (windows that the test prompts
cross, soft-caps, biases, partial rotary, odd head sizes, tied and untied heads)."""

from __future__ import annotations

import importlib
import pkgutil


def all_specs() -> dict[str, tuple[str, dict]]:
    specs: dict[str, tuple[str, dict]] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        clash = specs.keys() & module.SPECS.keys()
        assert not clash, f"tiny model kinds defined twice: {sorted(clash)}"
        specs.update(module.SPECS)
    return specs
