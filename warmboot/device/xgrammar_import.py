"""Importing xgrammar, once and lazily (by the first ``GrammarBackend`` or CPU bitmask
application), without the ``transformers`` import it would otherwise pull in: importing the
grammar modules then costs only what the engine pays anyway (torch)."""

from __future__ import annotations

import sys
import threading
import types
from typing import Any

_xgr: Any = None
_import_lock = threading.Lock()


def import_xgrammar() -> Any:
    """Import xgrammar once, without letting it import ``transformers`` (~0.5 s of cold start).

    xgrammar's ``tokenizer_info`` and ``contrib.hf`` modules import ``transformers`` at module
    level, only for ``TokenizerInfo.from_huggingface`` and an HF ``LogitsProcessor``, neither of
    which we use. While xgrammar loads, a stub module stands in for ``transformers`` (its
    attributes are placeholder classes) and is removed right after, so a later
    ``import transformers`` anywhere gets the real package. If transformers is already loaded,
    or the stubbed import fails, xgrammar is imported normally.
    """
    global _xgr
    if _xgr is not None:
        return _xgr
    with _import_lock:
        if _xgr is not None:
            return _xgr
        if "transformers" in sys.modules:
            import xgrammar

            _xgr = xgrammar
            return _xgr
        stub = types.ModuleType("transformers")

        def placeholder(name: str) -> type:
            if name.startswith("__"):
                raise AttributeError(name)
            cls = type(name, (), {"__module__": "transformers"})
            setattr(stub, name, cls)
            return cls

        stub.__getattr__ = placeholder
        sys.modules["transformers"] = stub
        try:
            import xgrammar
        except Exception:
            for name in [m for m in sys.modules if m == "xgrammar" or m.startswith("xgrammar.")]:
                del sys.modules[name]
            xgrammar = None
        finally:
            if sys.modules.get("transformers") is stub:
                del sys.modules["transformers"]
        if xgrammar is None:
            import xgrammar
        _xgr = xgrammar
        return _xgr
