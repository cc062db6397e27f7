"""Typed errors the engine raises; the HTTP layer maps them to OpenAI-shaped 4xx bodies."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine will not run. ``param`` names the offending field (OpenAI's ``param``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class EngineDeadError(RuntimeError):
    """The engine loop died; every in-flight request fails with this."""
