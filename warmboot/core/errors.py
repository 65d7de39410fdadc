"""Errors a caller of the engine sees (torch-free, so the HTTP side can import them)."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request that cannot be served; the engine keeps serving the others."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped; no request can be served."""
