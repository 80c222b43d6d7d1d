"""The trainers' settings (``docs/training.md``, "Defaults"): one ``TrainerConfig`` for every
backend. The reference trainer reads all of it; the Megatron trainer all but ``offload_dir``
(it offloads to host memory), with its own ``MegatronOptions`` for what only it has."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field


class TrainerConfig(BaseModel):
    """The loss, the batch layout and the optimizer, for every trainer backend; the
    defaults fit the tiny model (``pearl model init``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lr: float = Field(3e-3, gt=0, description="AdamW's learning rate.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW's beta1, beta2.")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW's epsilon.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW's decoupled weight decay.")
    grad_clip: float | None = Field(
        1.0, gt=0, description="Clip the gradient's global L2 norm to this; None: never."
    )
    eps_clip: float = Field(0.2, gt=0, description="PPO's clip: the ratio kept in 1 +- this.")
    eps_clip_high: float | None = Field(
        None, gt=0, description="The upper clip (1 + this), DAPO's clip-higher; None: eps_clip."
    )
    decoupled: bool = Field(
        True,
        description="AReaL's decoupled loss: the ratio against the proximal policy (the "
        "weights at the start of the update) times the capped behaviour importance weight; "
        "False: the ratio against the behaviour logprobs.",
    )
    behav_imp_weight_cap: float | None = Field(
        5.0,
        gt=1,
        description="Decoupled loss: tokens whose behaviour weight exp(proximal - behaviour) "
        "exceeds this are masked out of the loss; None: no cap.",
    )
    kl_coef: float = Field(
        0.0, ge=0, description="The weight of the k3 KL to the reference model; 0: none."
    )
    scale_advantages_by_std: bool = Field(
        True, description="Divide a group's centred rewards by its std (False: Dr. GRPO)."
    )
    advantage_eps: float = Field(1e-5, gt=0, description="Added to the group's std.")
    minibatches: int = Field(
        1, ge=1, description="Optimizer steps per update: the batch's sequences in this many parts."
    )
    max_tokens_per_microbatch: int = Field(
        4096,
        ge=1,
        description="Padded tokens (sequences x longest) per forward; gradients accumulate "
        "over a minibatch's microbatches. A longer sequence goes alone.",
    )
    masked_end_reasons: tuple[str, ...] = Field(
        ("agent_error", "turn_failed"),
        description="Trajectories that ended so are masked out of the loss and of their "
        "group's advantage.",
    )
    seed: int = Field(0, ge=0, description="Seeds the generator that shuffles minibatches.")
    threads: int | None = Field(
        None, ge=1, description="torch.set_num_threads (process-wide); None: torch's default."
    )
    offload_dir: Path | None = Field(
        None, description="Where offload writes the state; None: a new temporary directory."
    )
