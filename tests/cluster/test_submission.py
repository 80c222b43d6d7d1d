"""Submission parameters: what submitit writes into the sbatch script is what we render."""

from __future__ import annotations

import pytest
import submitit.slurm.slurm as submitit_slurm

from pearl.cluster.submission import (
    Submission,
    run_of_comment,
    sbatch_options,
    submitit_parameters,
)
from pearl.core.decision import ElasticRequest

REQUEST = ElasticRequest(num_gpus=16, gpu_type="h800", partition="elastic", time_limit_min=60)


def test_submitit_renders_exactly_our_sbatch_options(tmp_path: object) -> None:
    s = Submission("run7", "el0003", REQUEST, gpus_per_node=8, qos="spot", signal_delay_s=45)
    script = submitit_slurm._make_sbatch_string(
        command="true", folder=str(tmp_path), **submitit_parameters(s)
    )
    lines = {ln.removeprefix("#SBATCH ") for ln in script.splitlines() if ln.startswith("#SBATCH")}
    assert set(sbatch_options(s)) <= lines
    assert "--nodes=2" in lines and "--gres=gpu:h800:8" in lines
    assert "--comment=pearl:run=run7,allocation=el0003" in lines


def test_small_requests_take_one_node_with_their_gpus() -> None:
    req = ElasticRequest(num_gpus=2, gpu_type="h20", partition="elastic", time_limit_min=5)
    p = submitit_parameters(Submission("r", "a", req, gpus_per_node=4))
    assert (p["nodes"], p["gres"]) == (1, "gpu:h20:2")
    assert "qos" not in p


def test_the_comment_finds_the_run_again() -> None:
    s = Submission("run-1.b", "el0001", REQUEST, gpus_per_node=8)
    assert run_of_comment(s.comment) == ("run-1.b", "el0001")
    assert run_of_comment("someone else's job") is None
    assert s.job_name == "pearl-run-1.b-el0001"


@pytest.mark.parametrize("bad", ["", "a b", "x,y", "-lead"])
def test_ids_that_would_break_the_comment_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="run_id"):
        Submission(bad, "el0001", REQUEST, gpus_per_node=8)
