"""Sampling a token from a sequence's logits, and the logprobs the response reports.

Logprobs are of the model's raw distribution (log-softmax of the logits, before
temperature and top-p), as vLLM reports them by default (``logprobs_mode=raw_logprobs``).
Temperature 0 is greedy. A request's ``seed`` gives it its own generator, so its samples do
not depend on what else runs in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pearl.engines.reference.sequence import SamplingParams


@dataclass(frozen=True)
class Sampled:
    token_id: int
    logprob: float
    top_logprobs: dict[int, float]  # empty unless top-k logprobs were asked for


def sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> Sampled:
    """One token from ``logits`` ``[vocab]`` (float32)."""
    logprobs = torch.log_softmax(logits, dim=-1)
    if params.temperature == 0.0:
        token = int(torch.argmax(logits))
    else:
        probs = torch.softmax(logits / params.temperature, dim=-1)
        if params.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < params.top_p
            keep[0] = True
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
        token = int(torch.multinomial(probs, 1, generator=generator))
    top: dict[int, float] = {}
    if params.logprobs:
        values, ids = torch.topk(logprobs, min(params.logprobs, logprobs.shape[-1]))
        top = {int(i): float(v) for i, v in zip(ids, values, strict=True)}
    return Sampled(token, float(logprobs[token]), top)
