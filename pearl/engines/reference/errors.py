"""The reference engine's request errors: each becomes a 400 with vLLM's JSON error body."""

from __future__ import annotations


class BadRequestError(ValueError):
    """A request that cannot be served as asked; the route answers 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
