from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pearl.core.pd import GpuBudget, InstanceSpec, PDConfig, PDMode, fits, fits_budget
from pearl.core.roles import Role


def _fits_one_by_one(node_sizes: tuple[int, ...], tps: list[int]) -> bool:
    """Reference: best fit decreasing, one instance at a time."""
    free = list(node_sizes)
    for tp in sorted(tps, reverse=True):
        room = [i for i, f in enumerate(free) if f >= tp]
        if not room:
            return False
        best = min(room, key=lambda i: free[i])
        free[best] -= tp
    return True


@given(
    st.lists(st.sampled_from([1, 2, 4, 6, 8]), min_size=0, max_size=12),
    st.lists(st.sampled_from([1, 2, 4, 8]), min_size=0, max_size=40),
)
def test_grouped_packing_matches_one_by_one(nodes: list[int], tps: list[int]) -> None:
    sizes = tuple(sorted(nodes, reverse=True))
    assert fits(sizes, tps) == _fits_one_by_one(sizes, tps)


def test_power_of_two_degrees_fill_nodes_exactly() -> None:
    assert fits((8, 8), [4, 2, 2, 1, 1, 1, 1, 4])
    assert not fits((8, 8), [4, 4, 4, 2, 2, 1])
    assert not fits((4, 4), [8])


def test_config_identity_and_labels() -> None:
    a = PDConfig.of(
        {InstanceSpec(Role.DECODE, "h100", 1): 3, InstanceSpec(Role.PREFILL, "h100", 2): 1}
    )
    b = PDConfig.of(
        [InstanceSpec(Role.PREFILL, "h100", 2)] + [InstanceSpec(Role.DECODE, "h100", 1)] * 3
    )
    assert a == b and hash(a) == hash(b)
    assert a.mode is PDMode.DISAGGREGATED and a.num_gpus == 5
    assert a.label().startswith("disaggregated 1P:3D")
    assert PDConfig().mode is PDMode.NONE


def test_fits_budget_per_type() -> None:
    budget = GpuBudget.of({"h100": [8], "h20": [4]})
    ok = PDConfig.of(
        {InstanceSpec(Role.COLOCATED, "h100", 8): 1, InstanceSpec(Role.DECODE, "h20", 4): 1}
    )
    too_big = PDConfig.of({InstanceSpec(Role.COLOCATED, "h20", 8): 1})
    assert fits_budget(ok, budget) and not fits_budget(too_big, budget)
