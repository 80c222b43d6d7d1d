"""The batch layout both trainers train on (``pearl.trainer.batching``): what is a loss
token, the advantages, the minibatch and microbatch cuts."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from rollouts import batch_of, trajectory  # noqa: E402

from pearl.agents.batches import RolloutBatch  # noqa: E402
from pearl.agents.loop import Trajectory  # noqa: E402
from pearl.trainer.batching import layout  # noqa: E402
from pearl.trainer.config import TrainerConfig  # noqa: E402


def test_a_batch_collates_right_padded_with_unusable_tokens_masked() -> None:
    a, b = Trajectory(traj_id="a", reward=1.0), Trajectory(traj_id="b", reward=0.0)
    a.append([1, 2], generated=False)
    a.append([3, 4, 5], generated=True, logprobs=[-0.5, float("-inf"), -1.5], versions=[0] * 3)
    b.append([6], generated=False)
    b.append([7], generated=True, logprobs=[-2.0], versions=[0])
    batch = RolloutBatch(0, 0, (a, b), (0, 0), 0, 0, 0.0)
    lay = layout(batch, TrainerConfig(), torch.Generator().manual_seed(0))
    [[m]] = lay.minibatches
    rows = sorted(range(2), key=lambda i: -int(m.mask[i].sum()))  # longest first: a, b
    assert m.ids[rows].tolist() == [[1, 2, 3, 4, 5], [6, 7, 0, 0, 0]]
    # entry t is about token t: a's tokens 3 and 5 (4's logprob is -inf), b's token 7
    assert m.mask[rows].int().tolist() == [[0, 0, 1, 0, 1], [0, 1, 0, 0, 0]]
    assert m.behaviour[rows].tolist() == [[0, 0, -0.5, 0, -1.5], [0, -2.0, 0, 0, 0]]
    adv = 0.5 / (0.5**0.5 + 1e-5)  # (1 - mean) / (the unbiased std of {1, 0} + eps)
    assert m.advantages[rows].flatten().tolist() == pytest.approx([adv] * 5 + [-adv] * 5)
    assert (lay.tokens, lay.off_policy_tokens, m.tokens) == (3, 0, 3)


def test_minibatches_and_microbatches_cut_as_configured() -> None:
    trajs = [
        trajectory(f"t{i}", [1, 2], [3] * (1 + i % 3), [-1.0] * (1 + i % 3), 0, float(i))
        for i in range(8)
    ]
    trajs[2].end_reason = "turn_failed"
    config = TrainerConfig(minibatches=3, max_tokens_per_microbatch=10)
    lay = layout(batch_of(0, 1, trajs, 4), config, torch.Generator().manual_seed(1))
    assert len(lay.sequences) == 7 and lay.off_policy_tokens == lay.tokens  # all version 0
    assert sorted(sum(len(m.ids) for m in mb) for mb in lay.minibatches) == [2, 2, 3]
    for m in lay.microbatches():
        assert m.ids.numel() <= 10 or len(m.ids) == 1
    assert sorted(lay.rewards.tolist()) == [0, 1, 3, 4, 5, 6, 7]
