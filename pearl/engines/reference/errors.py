"""The reference engine's request errors: each becomes a 400 with vLLM's JSON error body."""

from __future__ import annotations


class BadRequestError(ValueError):
    """A request that cannot be served as asked; the route answers 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


MAX_WEIGHT_VERSION = 2**63 - 1  # an int64, as every integer of a request


def weight_version_of(value: object, param: str) -> int | None:
    """A request's ``weight_version`` (None: not given), or a ``BadRequestError`` naming
    ``param``: an integer from 0 to int64's largest, not a bool or a float."""
    if value is None:
        return None
    if type(value) is not int or not 0 <= value <= MAX_WEIGHT_VERSION:
        shown = repr(value)[:80]
        raise BadRequestError(
            f"{param}: an integer from 0 to {MAX_WEIGHT_VERSION} is required ({shown} given)",
            param.split(".")[0],
        )
    return value
