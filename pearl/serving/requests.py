"""Requests to an inference instance and their continuations.

A ``Request`` is one turn of one trajectory (or what is left of it) sent to one instance:
its whole prompt (``context_tokens``), the tokens it is to generate and, for the decode
half of a disaggregated turn, the prompt tokens whose KV already arrived from a prefill
instance. A request taken off an instance (drain, migration, a node that left) comes back
as a ``PartialOutput``; its ``continuation`` is a new request whose prompt holds the
tokens generated so far, so nothing is lost or generated twice.

Invariants: ``continuation`` keeps the turn's total (prompt + output) tokens and the
trajectory; its prompt grows by exactly the tokens generated.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Request:
    """One turn of one trajectory sent to an instance."""

    request_id: str
    traj_id: str
    context_tokens: int  # the whole prompt of this turn
    output_tokens: int  # tokens to generate (ignored by prefill instances)
    kv_ready_tokens: int = 0  # prompt tokens whose KV arrived from a prefill instance


@dataclass(frozen=True, slots=True)
class PartialOutput:
    """A request taken off an instance, with the tokens it generated there so far."""

    request: Request
    num_generated_tokens: int

    def continuation(self, request_id: str) -> Request:
        """The rest of the turn as a new request (its output so far joins the prompt)."""
        r = self.request
        return Request(
            request_id,
            r.traj_id,
            r.context_tokens + self.num_generated_tokens,
            r.output_tokens - self.num_generated_tokens,
        )
