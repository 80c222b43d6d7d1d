"""The scenario family (``pearl.sim.family``) and ``pearl family`` end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import sim_fixtures as F
import yaml

from pearl.cli.family import base_of, family_variants, validated
from pearl.cli.main import main
from pearl.io.scenarios import load_scenario
from pearl.sim.availability import GPUS_PER_NODE
from pearl.sim.family import (
    LONG_WINDOW,
    OVERSUBSCRIPTION,
    SHORT_WINDOW,
    BaseScenario,
    canonical,
    drawn,
    elastic_supply,
)

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = [
    ROOT / "benchmarks/scenarios/qwen3-8b.yaml",
    ROOT / "benchmarks/scenarios/qwen3-30b-a3b.yaml",
]
BASE = BaseScenario("b", rollout_gpus=32, trainer_gpu_type="h800", elastic_gpu_type="h800")


@pytest.mark.parametrize("window", [LONG_WINDOW, SHORT_WINDOW])
@pytest.mark.parametrize("factor", [0.5, 1.0, 2.0])
def test_elastic_supply_is_capped_at_factor_times_the_base_rollout_gpus_and_oversubscribed(
    factor: float, window: tuple[float, float]
) -> None:
    fields = dict(elastic_supply(BASE, factor, window))
    syn = fields["elastic.synthetic"]
    cap_gpus = factor * BASE.rollout_gpus
    assert syn["max_gpus"] == cap_gpus
    assert fields["policy.elastic.max_allocations"] * GPUS_PER_NODE == cap_gpus
    median_s, sigma = window
    assert (syn["lifetime_median_s"], syn["lifetime_sigma"]) == window
    mean_open_nodes = syn["arrivals_per_h"] * median_s * math.exp(sigma**2 / 2) / 3600
    assert mean_open_nodes * GPUS_PER_NODE == pytest.approx(OVERSUBSCRIPTION * cap_gpus, rel=1e-5)


def test_no_supply_is_no_elastic_source() -> None:
    fields = dict(elastic_supply(BASE, 0.0, LONG_WINDOW))
    assert fields["elastic.source"] == "none" and fields["elastic.synthetic"] is None
    assert dict(elastic_supply(BASE, 0.1, LONG_WINDOW))["elastic.source"] == "none"  # < a node


def test_every_canonical_variant_of_the_shipped_scenarios_is_a_valid_scenario() -> None:
    family = family_variants(SHIPPED, None, 0, None)
    names = [v.name for v, _, _ in family]
    assert len(names) == len(set(names)) == 2 * 15
    scenarios = {p[0][1]: sc for p, sc, _ in validated(family, None)}
    shipped = scenarios["qwen3-8b/shipped"]
    assert shipped.model_dump(exclude={"name"}) == load_scenario(SHIPPED[0]).model_dump(
        exclude={"name"}
    )
    twice = scenarios["qwen3-30b-a3b/elastic-2x"]
    assert twice.elastic.synthetic is not None and twice.elastic.synthetic.max_gpus == 128
    assert twice.policy.elastic.max_allocations == 16
    assert scenarios["qwen3-8b/elastic-0x"].elastic.source == "none"
    assert scenarios["qwen3-8b/homogeneous"].cluster.rollout.gpu_type == "h800"
    assert scenarios["qwen3-8b/groups-16"].rollout.group_size == 16
    assert scenarios["qwen3-8b/tools-30s"].rollout.workload.env_latency_s == 30.0
    # nothing is tuned per variant: pearl's policy section is the base's but the partition
    for name, sc in scenarios.items():
        base = scenarios[name.split("/")[0] + "/shipped"]
        assert sc.policy.model_dump(exclude={"elastic"}) == base.policy.model_dump(
            exclude={"elastic"}
        )
        assert sc.policy.elastic.model_dump(
            exclude={"max_allocations", "gpus_per_allocation"}
        ) == base.policy.elastic.model_dump(exclude={"max_allocations", "gpus_per_allocation"})


def test_drawn_variants_are_reproducible_valid_and_within_their_ranges() -> None:
    bases = {b.name: b for b in (base_of(load_scenario(p)) for p in SHIPPED)}
    a = drawn(bases, np.random.default_rng(7), 20)
    assert a == drawn(bases, np.random.default_rng(7), 20)
    assert a != drawn(bases, np.random.default_rng(8), 20)
    for variant in a:
        fields = dict(variant.point)
        assert 0.01 <= fields["rollout.workload.env_latency_s"] <= 30.0
        assert 32 <= fields["rollout.workload.output_tokens_per_turn"] <= 1024
        assert 1.0 <= fields["rollout.workload.turns_per_trajectory"] <= 12.0
        assert fields["rollout.group_size"] in (1, 2, 4, 8, 16)
    family = family_variants(SHIPPED, 20, 7, None)
    assert [v for v, _, _ in family] == a
    assert len(validated(family, None)) == 20


def test_canonical_names_each_base_and_axis() -> None:
    names = [v.name for v in canonical({"b": BASE})]
    assert names[0] == "b/shipped" and "b/elastic-2x" in names and "b/turns-12" in names


def test_the_command_runs_the_policies_on_the_chosen_variants(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = tmp_path / "tiny.yaml"
    base.write_text(yaml.safe_dump(F.scenario_dict(batch=16)), encoding="utf-8")
    out = tmp_path / "out"
    argv = ["family", str(base), "--only", "shipped,groups-16", "--seeds", "1"]
    argv += ["--duration-s", "300", "--policies", "pearl,roll-fixed", "--jobs", "1"]
    code = main([*argv, "--out", str(out), "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    result = json.loads(captured.out)
    assert [p["point"] for p in result["points"]] == [
        {"variant": "tiny/shipped"},
        {"variant": "tiny/groups-16"},
    ]
    assert result["points"][1]["fields"] == {"rollout.group_size": 16}
    for p in result["points"]:
        tph = {n: e["throughput_traj_per_h"] for n, e in p["policies"].items()}
        assert tph["pearl"] > 0 and tph["roll-fixed"] > 0
    assert set(result["worst_ratio"]) == {"roll-fixed"}
    assert (out / "family.md").read_text(encoding="utf-8").startswith("| variant |")
    assert json.loads((out / "family.json").read_text(encoding="utf-8")) == result


def test_a_variant_the_base_cannot_take_is_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = F.scenario_dict(batch=24)  # groups of 16 do not divide a batch of 24
    base = tmp_path / "tiny.yaml"
    base.write_text(yaml.safe_dump(doc), encoding="utf-8")
    code = main(["family", str(base), "--only", "groups-16", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "tiny/groups-16" in err[0], err
