"""``pearl sweep``: the grid (pure), and the command end to end on a small scenario."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import sim_fixtures as F
import yaml

from pearl.cli.main import main
from pearl.io.simulation import run_inputs
from pearl.sim.baselines import make_policy
from pearl.sim.runner import simulate
from pearl.sim.scenario import Scenario
from pearl.sim.sweep import Axis, SweepError, grid, ratios, with_point, worst

# --- the grid ----------------------------------------------------------------------------


def test_the_grid_is_the_product_of_the_axes_the_last_varying_fastest() -> None:
    axes = [Axis("rollout.group_size", (1, 4)), Axis("duration_s", (60.0, 120.0, 180.0))]
    points = grid(axes)
    assert len(points) == 6
    assert points[0] == (("rollout.group_size", 1), ("duration_s", 60.0))
    assert points[1] == (("rollout.group_size", 1), ("duration_s", 120.0))
    assert points[-1] == (("rollout.group_size", 4), ("duration_s", 180.0))


@pytest.mark.parametrize(
    ("axes", "field"),
    [
        ([Axis("rollout..group_size", (1,))], "rollout..group_size"),
        ([Axis("a", (1,)), Axis("a", (2,))], "a"),
        ([Axis("a", ())], "a"),
        ([Axis("a", tuple(range(200))), Axis("b", tuple(range(200)))], "b"),
    ],
    ids=["not-a-path", "twice", "no-values", "too-many-points"],
)
def test_bad_axes_name_their_field(axes: list[Axis], field: str) -> None:
    with pytest.raises(SweepError) as err:
        grid(axes)
    assert err.value.field == field


def test_a_point_sets_its_fields_in_a_copy_adding_what_the_document_leaves_out() -> None:
    doc = F.scenario_dict()
    point = (("rollout.group_size", 4), ("policy.elastic.min_gain_s_per_gpu", 0.5))
    varied = with_point(doc, point)
    assert varied["rollout"]["group_size"] == 4
    assert varied["policy"]["elastic"]["min_gain_s_per_gpu"] == 0.5
    assert (
        doc["rollout"]["group_size"] == 1 and "min_gain_s_per_gpu" not in doc["policy"]["elastic"]
    )
    Scenario.model_validate(varied)  # still a scenario
    with pytest.raises(SweepError) as err:
        with_point(doc, (("duration_s.seconds", 1),))
    assert err.value.field == "duration_s.seconds"


def test_ratios_and_the_worst_of_them() -> None:
    r = ratios({"pearl": 120.0, "roll-fixed": 100.0, "rlboost-plus": 0.0, "oracle": 300.0})
    assert r["roll-fixed"] == pytest.approx(1.2) and math.isnan(r["rlboost-plus"])
    assert "oracle" not in r
    a, b = (("x", 1),), (("x", 2),)
    assert worst([(a, {"roll-fixed": 1.2}), (b, {"roll-fixed": 0.9})]) == {"roll-fixed": (0.9, b)}


# --- the command ---------------------------------------------------------------------------


def _scenario_file(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(F.scenario_dict(elastic=True, batch=16)), encoding="utf-8")
    return path


def test_a_sweep_runs_every_policy_on_every_point(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    scenario, out = _scenario_file(tmp_path), tmp_path / "out"
    argv = ["sweep", str(scenario), "--vary", "rollout.group_size=1,4", "--seeds", "1"]
    argv += ["--duration-s", "300", "--policies", "pearl,roll-fixed,oracle", "--jobs", "2"]
    code = main([*argv, "--out", str(out), "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    result = json.loads(captured.out)
    assert [p["point"] for p in result["points"]] == [
        {"rollout.group_size": 1},
        {"rollout.group_size": 4},
    ]
    for p in result["points"]:
        tph = {n: e["throughput_traj_per_h"] for n, e in p["policies"].items()}
        assert tph["pearl"] > 0 and tph["roll-fixed"] > 0
        assert p["ratios"] == {"roll-fixed": pytest.approx(tph["pearl"] / tph["roll-fixed"])}
    # the point with groups of 4 is the run pearl simulate makes of that variant
    doc = with_point(F.scenario_dict(elastic=True, batch=16), (("rollout.group_size", 4),))
    sc = Scenario.model_validate({**doc, "duration_s": 300.0})
    alone = simulate(run_inputs(sc, F.profile(), 0), make_policy("pearl", sc.policy, 1))
    assert result["points"][1]["policies"]["pearl"]["throughput_traj_per_h"] == pytest.approx(
        alone.trajectories / (300.0 / 3600)
    )
    assert (
        json.loads((out / "sweep.json").read_text(encoding="utf-8"))["points"] == result["points"]
    )
    table = (out / "sweep.md").read_text(encoding="utf-8")
    assert "| rollout.group_size |" in table and "pearl / roll-fixed: worst" in table
    assert (out / "sweep.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize(
    ("vary", "named"),
    [
        ("rollout.group_size", "--vary"),
        ("rollout.group_size=one", "rollout.group_size"),
        ("rollout.surprise=1,2", "rollout.surprise"),
        ("rollout.group_size={a: 1}", "--vary rollout.group_size"),
    ],
    ids=["no-values", "not-a-number", "unknown-field", "not-a-scalar"],
)
def test_a_bad_axis_is_one_line_and_exit_2_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], vary: str, named: str
) -> None:
    scenario, out = _scenario_file(tmp_path), tmp_path / "out"
    code = main(["sweep", str(scenario), "--vary", vary, "--out", str(out)])
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert code == 2 and len(err) == 1 and named in err[0], err
    assert captured.out == "" and not out.exists()
