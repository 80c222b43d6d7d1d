"""The multi-turn agent loop: prompt, model turn, tool call, environment step, observation,
next turn, until the environment ends the episode or a limit is reached.

``run_episode`` runs one trajectory through the router and keeps what the trainer needs:
every token of the conversation in order, a loss mask (1 for tokens the model generated,
0 for the prompt and the observations), the logprob and the weight version of every
generated token (0.0 and -1 elsewhere), per-turn timings, the reward, and why it ended.

Tokens, not text, carry the conversation from turn to turn: turn ``k + 1``'s prompt is turn
``k``'s prompt, its output tokens as generated, and the observation's tokens, so every
prompt extends the one before (the engine's prefix cache holds it; the trainer's tokens
are those the model saw). The first prompt is the model's chat template over the
environment's system prompt, tools and first observation; an observation is appended as a
ChatML fragment: the end of the assistant's message (when the model did not end it), a
user message ``<tool_response>...</tool_response>``, and the assistant header.

How an episode ends (``Trajectory.end_reason``): the environment's own reason
(``info["end_reason"]``: an answer, its turn limit, an env error, timeout or an
observation too long) or ``terminated`` / ``truncated``; ``max_turns`` (this loop's
limit); ``context_limit`` (the next turn would not fit ``max_context_tokens``);
``turn_failed`` (the router gave the turn up). None of them raises: a bad environment
ends its trajectory, never the rollout.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from pearl.engines.reference.tokenizer import Tokenizer
from pearl.envs.protocol import Environment
from pearl.envs.robust import safe_reset, safe_step
from pearl.router.router import Router, Sampling, Turn, TurnFailed, TurnOutput

log = logging.getLogger(__name__)

NOT_GENERATED = -1  # the version of a token the model did not generate


@dataclass(frozen=True)
class Limits:
    max_turns: int = 8
    max_context_tokens: int = 4096
    step_timeout_s: float = 30.0
    max_observation_chars: int = 4000


@dataclass(frozen=True)
class TurnRecord:
    prompt_tokens: int
    output_tokens: int
    started_s: float
    ended_s: float
    env_s: float  # the environment's step after it
    served_by: tuple[str, ...]
    finish_reason: str | None
    prefilled_by: tuple[str, ...] = ()
    continuations: int = 0


@dataclass
class Trajectory:
    traj_id: str
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: list[TurnRecord] = field(default_factory=list)
    reward: float = 0.0
    end_reason: str = ""
    info: dict[str, Any] = field(default_factory=dict)

    def append(
        self,
        ids: list[int],
        *,
        generated: bool,
        logprobs: list[float] | None = None,
        versions: list[int] | None = None,
    ) -> None:
        self.token_ids += ids
        self.loss_mask += [int(generated)] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.versions += versions if versions is not None else [NOT_GENERATED] * len(ids)

    @property
    def generated_tokens(self) -> int:
        return sum(self.loss_mask)


class EpisodeHooks(Protocol):
    """What the rollout manager hears of an episode while it runs (all optional to act on;
    each is called from the episode's task, between its awaits)."""

    def turn_sent(self, traj_id: str, turn: int, context_tokens: int) -> None:
        """Turn ``turn``'s request goes out with ``context_tokens`` of prompt."""

    def model_turn_ended(self, traj_id: str, turn: int, out: TurnOutput) -> None:
        """The model's output of the turn is complete; its tool step runs next."""

    def env_step_ended(
        self, traj_id: str, record: TurnRecord, observation_tokens: int | None
    ) -> None:
        """The turn's environment step ended: ``observation_tokens`` were appended, or
        (None) the step ended the episode."""


def first_prompt(tok: Tokenizer, env: Environment, observation: str) -> list[int]:
    messages: list[dict[str, Any]] = []
    if env.system_prompt:
        messages.append({"role": "system", "content": env.system_prompt})
    messages.append({"role": "user", "content": observation})
    return tok.encode(tok.apply_chat_template(messages, tools=env.tools or None))


def observation_tokens(tok: Tokenizer, observation: str, model_ended: bool) -> list[int]:
    """The tokens appended after a model turn: see the module docstring."""
    close = "" if model_ended else "<|im_end|>"
    text = (
        f"{close}\n<|im_start|>user\n<tool_response>\n{observation}\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    return tok.encode(text)


async def run_episode(
    router: Router,
    env: Environment,
    tok: Tokenizer,
    traj_id: str,
    sampling: Sampling,
    limits: Limits = Limits(),
    seed: int | None = None,
    hooks: EpisodeHooks | None = None,
) -> Trajectory:
    traj = Trajectory(traj_id)
    try:
        start = await safe_reset(
            env,
            seed,
            timeout_s=limits.step_timeout_s,
            max_observation_chars=limits.max_observation_chars,
        )
        traj.info = dict(start.info)
        if start.done:
            traj.end_reason = str(start.info.get("end_reason", "truncated"))
            return traj
        traj.append(first_prompt(tok, env, start.observation), generated=False)
        while True:
            if len(traj.turns) >= limits.max_turns:
                traj.end_reason = "max_turns"
                break
            if len(traj.token_ids) + sampling.max_tokens > limits.max_context_tokens:
                traj.end_reason = "context_limit"
                break
            turn_id = f"{traj_id}-t{len(traj.turns)}"
            prompt_tokens = len(traj.token_ids)
            if hooks:
                hooks.turn_sent(traj_id, len(traj.turns), prompt_tokens)
            out = await router.generate(Turn(traj_id, tuple(traj.token_ids), sampling, turn_id))
            traj.append(out.token_ids, generated=True, logprobs=out.logprobs, versions=out.versions)
            if hooks:
                hooks.model_turn_ended(traj_id, len(traj.turns), out)
            t_env = time.monotonic()
            step = await safe_step(
                env,
                tok.decode(out.token_ids),
                limits.step_timeout_s,
                max_observation_chars=limits.max_observation_chars,
            )
            env_s = time.monotonic() - t_env
            record = TurnRecord(
                prompt_tokens,
                len(out.token_ids),
                out.started_s,
                out.ended_s,
                env_s,
                tuple(out.served_by),
                out.finish_reason,
                tuple(out.prefilled_by),
                out.continuations,
            )
            traj.turns.append(record)
            traj.info.update(step.info)
            if step.done:
                traj.reward = step.reward
                default = "terminated" if step.terminated else "truncated"
                traj.end_reason = str(step.info.get("end_reason", default))
                if hooks:
                    hooks.env_step_ended(traj_id, record, None)
                break
            ended = bool(out.token_ids) and out.token_ids[-1] == tok.eos_token_id
            obs = observation_tokens(tok, step.observation, ended)
            traj.append(obs, generated=False)
            if hooks:
                hooks.env_step_ended(traj_id, record, len(obs))
    except TurnFailed as err:
        traj.end_reason = "turn_failed"
        traj.info["error"] = str(err)
    finally:
        router.forget(traj_id)
        await _close(env, limits.step_timeout_s)
    return traj


async def _close(env: Environment, timeout_s: float) -> None:
    """Close the environment, within ``timeout_s``: a close that fails or hangs is logged,
    never the episode's (or a cancelling caller's) problem."""
    try:
        await asyncio.wait_for(env.close(), timeout_s)
    except Exception as err:  # a broken environment's close
        log.warning("environment close failed: %s: %s", type(err).__name__, err)
