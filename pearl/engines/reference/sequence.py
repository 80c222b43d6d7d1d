"""One request's sequence in the reference engine: its tokens, sampling, blocks and state."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Finish(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # top-k logprobs per token (0: the sampled token's only)


@dataclass(frozen=True)
class RemoteKV:
    """A prefill's keys, values and last logits, pulled from another instance."""

    keys: torch.Tensor  # [layers, prompt_tokens, kv_heads, head_dim]
    values: torch.Tensor
    logits: torch.Tensor  # [vocab]: the prompt's last position


@dataclass(frozen=True)
class TokenEvent:
    """What the engine reports of a sequence after a step: its new tokens, and the
    finish reason once it has finished."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    top_logprobs: tuple[dict[int, float], ...]
    versions: tuple[int, ...]
    finish: Finish | None = None
    stop_reason: int | str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    prefill_s: float | None = None  # set with the first token


@dataclass(eq=False)
class Seq:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    emit: Callable[[TokenEvent], None]
    arrival_s: float
    hold_kv: bool = False  # a prefill for a remote decode: keep the KV when finished
    remote: RemoteKV | None = None  # a decode whose prompt's KV comes from a prefill
    output_ids: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose keys and values are in the cache
    num_hashed_blocks: int = 0
    block_hashes: list[int] = field(default_factory=list)  # of the full blocks, chained
    cacheable: bool = True  # False once its KV mixes two weight versions (a load mid-run)
    status: Status = Status.WAITING
    generator: torch.Generator | None = None
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    computed_prompt_tokens: int = 0  # prompt tokens this engine computed (not cached, not pulled)
    cached_prompt_tokens: int = 0
    last_logits: torch.Tensor | None = None  # kept for a held prefill

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def pending(self) -> int:
        """Tokens to feed before the next token can be sampled."""
        return self.num_tokens - self.num_computed

    def slots(self, block_size: int, upto: int) -> torch.Tensor:
        """The slots of positions ``0 .. upto - 1``."""
        blocks = torch.as_tensor(self.blocks, dtype=torch.long)
        return (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:upto]
