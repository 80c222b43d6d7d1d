"""The routing rules (pearl.serving.routing) on hand-made views with the shipped Qwen3-8B
profile's coefficients: cost-aware prefix affinity across output lengths and queue states,
least loaded with its tie-break, prefill -> decode, and the search shortcut's exactness."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pearl.core.profile import EngineProfile
from pearl.core.roles import Role
from pearl.io.documents import load_profile
from pearl.serving.costs import (
    attention_pairs,
    expected_wait_s,
    prompt_ready_s,
    stall_s,
    turn_s,
)
from pearl.serving.routing import (
    candidates,
    kv_slots,
    least_loaded,
    mean_context_tokens,
    route_decode,
    route_turn,
    turn_work_s,
)
from pearl.serving.views import InstanceQueue, full

# The shipped workload's means (docs/simulator.md): prompt, observation per turn.
PROMPT_TOKENS, OBSERVATION_TOKENS = 5330, 614


@dataclass(frozen=True)
class Load:
    """An ``InstanceLoad`` as a router's record of an instance."""

    worker_id: str
    role: Role = Role.COLOCATED
    accepting: bool = True
    load: int = 0
    slots: int | None = None
    kv_slots: int | None = None
    turn_s: float | None = None


@cache
def engine(gpu_type: str = "h20", tp: int = 1) -> EngineProfile:
    e = load_profile("qwen3-8b").engine(gpu_type, tp)
    assert e is not None
    return e


def turn(output_tokens: int, index: int = 3) -> tuple[int, int]:
    """(prompt, cached prefix) of turn ``index`` of a trajectory with these outputs: the
    prefix is the previous turn's prompt and output, the prompt adds an observation."""
    prefix = PROMPT_TOKENS + (index - 1) * (OBSERVATION_TOKENS + output_tokens) + output_tokens
    return prefix + OBSERVATION_TOKENS, prefix


def returning_turns(
    n: int, decoding_seqs: int = 0, decoding_context_tokens: int = 0
) -> InstanceQueue:
    """A queue of ``n`` other trajectories' returning turns (900 new tokens after 7,000
    cached each) on an H20, beside a decoding batch."""
    pairs = n * attention_pairs(900, 7000)
    batch = n + decoding_seqs
    return InstanceQueue(
        engine(), 900 * n, pairs, decoding_seqs, decoding_context_tokens, batch_seqs=batch
    )


def fresh_prompts(n: int) -> InstanceQueue:
    """A queue of ``n`` first turns on an H20 (a whole prompt each, nothing cached)."""
    pairs = n * attention_pairs(PROMPT_TOKENS, 0)
    return InstanceQueue(engine(), PROMPT_TOKENS * n, pairs, batch_seqs=n)


def decoding(n: int) -> InstanceQueue:
    """An H20 decoding ``n`` sequences of 8,000 tokens, nothing queued."""
    return InstanceQueue(engine(), 0, 0, n, n * 8000, batch_seqs=n)


def idle(gpu_type: str = "h20", tp: int = 1) -> InstanceQueue:
    return InstanceQueue(engine(gpu_type, tp))


def route(
    prompt: int, prefix: int, output: float, home: InstanceQueue, alt: InstanceQueue
) -> str | None:
    """Home ``h`` (load 5) against an idler alternative ``a`` (load 1), with the search
    shortcut (the engines) and without it: both give the same route."""
    loads = [Load("h", load=5), Load("a", load=1)]
    queues = {"h": home, "a": alt}
    engines = {home.engine, alt.engine}
    fast = route_turn(
        prompt, output, candidates(loads), loads[0], prefix, queues.__getitem__, engines
    )
    assert fast == route_turn(
        prompt, output, candidates(loads), loads[0], prefix, queues.__getitem__
    )
    return fast


# --- cost-aware prefix affinity ------------------------------------------------------------


@pytest.mark.parametrize("output_tokens", [28, 262, 1000])
@pytest.mark.parametrize(
    "home",
    [idle(), returning_turns(1), returning_turns(2), fresh_prompts(1)],
    ids=["empty", "one-returning-turn", "two-returning-turns", "one-fresh-prompt"],
)
def test_a_turn_stays_home_while_the_wait_there_is_shorter_than_a_recompute(
    output_tokens: int, home: InstanceQueue
) -> None:
    # The rule it replaced left whenever home had anything queued: all but "empty" left.
    prompt, prefix = turn(output_tokens)
    assert route(prompt, prefix, output_tokens, home, idle()) == "h"


@pytest.mark.parametrize("output_tokens", [28, 262, 1000])
def test_a_turn_leaves_when_the_queue_ahead_costs_more_than_a_recompute(
    output_tokens: int,
) -> None:
    prompt, prefix = turn(output_tokens)
    assert route(prompt, prefix, output_tokens, fresh_prompts(6), idle()) == "a"
    # ... unless the alternative's own queue costs about as much
    assert route(prompt, prefix, output_tokens, fresh_prompts(6), fresh_prompts(5)) == "h"


def _break_even(prompt: int, prefix: int) -> int:
    """The fewest queued returning turns at home (nothing to decode) that make a turn
    leave an idle alternative."""
    for n in itertools.count():
        if route(prompt, prefix, 0, returning_turns(n), idle()) == "a":
            return n
    raise AssertionError("unreachable")


@pytest.mark.parametrize("output_tokens", [28, 262, 1000])
def test_the_break_even_queue_costs_about_the_recompute_of_the_prefix(output_tokens: int) -> None:
    prompt, prefix = turn(output_tokens)
    n = _break_even(prompt, prefix)
    recompute_s = prompt_ready_s(idle(), prompt) - prompt_ready_s(idle(), prompt, prefix)
    # the wait that still stays is at most the recompute, the one that leaves above it
    # (up to one step's fixed cost: the queue and the turn share prefill steps)
    slack_s = 2 * engine().prefill.a_s
    assert expected_wait_s(returning_turns(n - 1)) <= recompute_s + slack_s
    assert expected_wait_s(returning_turns(n)) > recompute_s - slack_s


def test_a_longer_prefix_tolerates_a_longer_queue() -> None:
    short = _break_even(*turn(28))
    long = _break_even(*turn(1000))
    late = _break_even(*turn(262, index=8))
    assert 1 <= short < long and short < late


def test_a_decoding_batch_at_home_slows_its_queue_and_can_tip_the_turn() -> None:
    prompt, prefix = turn(262)
    n = _break_even(prompt, prefix) - 1  # the longest queue that stays beside no batch
    busy = returning_turns(n, decoding_seqs=200, decoding_context_tokens=200 * 8000)
    assert expected_wait_s(busy) > expected_wait_s(returning_turns(n))
    assert route(prompt, prefix, 0, returning_turns(n), idle()) == "h"
    assert route(prompt, prefix, 0, busy, idle()) == "a"


def test_a_long_output_leaves_a_big_batch_for_an_idle_instance() -> None:
    # 40 sequences of 8,000 tokens make every decode step ~15 ms slower than alone: 262
    # or 1,000 tokens of it cost the turn more than the recompute
    assert route(*turn(262), 262, decoding(40), idle()) == "a"
    assert route(*turn(1000), 1000, decoding(40), idle()) == "a"
    # a batch of the same size elsewhere: no reason to leave
    assert route(*turn(1000), 1000, decoding(40), decoding(40)) == "h"


def own_s(queue: InstanceQueue, prompt: int, prefix: int, output: float) -> float:
    """A turn's own expected time on an instance (the rule without the stall term)."""
    return turn_s(prompt_ready_s(queue, prompt, prefix), queue, prompt, output)


def test_a_turn_weighs_the_stall_its_prompt_puts_on_the_sequences_decoding_there() -> None:
    """A move's recompute of thousands of tokens holds up every sequence decoding where it
    goes; a turn's few new tokens at home hold up those decoding at home. Weighed by its
    own time alone the turn would take the other side each time."""
    prompt, prefix = turn(28)
    # home has six fresh prompts queued (4.5 s), the alternative decodes 8 sequences:
    # the recompute there is quicker for the turn (1.3 s) but stalls 8 sequences ~1 s each
    home, alt = fresh_prompts(6), decoding(8)
    assert own_s(alt, prompt, 0, 28) < own_s(home, prompt, prefix, 28)
    assert stall_s(alt, prompt) > own_s(home, prompt, prefix, 28)
    assert route(prompt, prefix, 28, home, alt) == "h"
    assert route(prompt, prefix, 28, home, idle()) == "a"  # nothing to stall there
    # home decodes 40 sequences: 28 tokens in that batch cost the turn less than the
    # recompute, but its new tokens there stall 40 sequences, while an idle one has none
    home = decoding(40)
    assert own_s(home, prompt, prefix, 28) < own_s(idle(), prompt, 0, 28)
    assert route(prompt, prefix, 28, home, idle()) == "a"
    assert route(prompt, prefix, 28, decoding(2), idle()) == "h"
    assert stall_s(idle(), prompt) == 0.0
    assert stall_s(home, prompt, prefix) < stall_s(home, prompt)


def test_costs_are_each_instances_own_a_faster_engine_can_win_the_recompute() -> None:
    prompt, prefix = turn(262)
    home = fresh_prompts(1)  # 0.7 s of queue on an H20
    assert route(prompt, prefix, 262, home, idle()) == "h"
    assert route(prompt, prefix, 262, home, idle("h800", 2)) == "a"


def test_equal_times_stay_home() -> None:
    loads = [Load("h", load=5), Load("a", load=1)]
    q = fresh_prompts(2)
    assert route_turn(8000, 262, candidates(loads), loads[0], 0, lambda w: q) == "h"


def test_first_turns_and_homeless_turns_go_to_the_least_loaded_entry() -> None:
    loads = [Load("h", load=5), Load("a", load=1)]
    q = idle()
    assert route_turn(8000, 262, candidates(loads), None, 0, lambda w: q) == "a"
    for home in [
        Load("h", accepting=False, load=5),  # draining
        Load("h", role=Role.DECODE, load=5),  # no entry role
    ]:
        views = [home, Load("a", load=1)]
        assert route_turn(8000, 262, candidates(views), home, 7000, lambda w: q, [engine()]) == "a"


def test_a_turn_parks_when_no_instance_can_take_it() -> None:
    q = idle()
    assert route_turn(8000, 262, candidates([]), None, 0, lambda w: q) is None
    # prefill instances are no entry without an accepting decode instance to take the KV
    prefill = Load("p", role=Role.PREFILL)
    gone_decode = Load("d", role=Role.DECODE, accepting=False)
    assert (
        route_turn(8000, 262, candidates([prefill, gone_decode]), prefill, 7000, lambda w: q)
        is None
    )
    assert candidates([prefill, gone_decode]).entries == ()


def test_a_full_instance_takes_no_turn_and_a_turn_with_nowhere_else_parks() -> None:
    """A full instance (as many requests as it runs at once) would only queue the turn, in
    a queue that instances joining later never share: the turn goes where there is room,
    or waits parked."""
    q = {"h": returning_turns(0), "a": idle()}.__getitem__

    def routed(home: Load, alt: Load, first_turn: bool = False) -> str | None:
        among = candidates([home, alt])
        return route_turn(8000, 262, among, None if first_turn else home, 7000, q, [engine()])

    both_full = Load("h", load=4, slots=4), Load("a", load=4, slots=4)
    assert routed(*both_full) is None and routed(*both_full, first_turn=True) is None
    assert routed(Load("h", load=4, slots=4), Load("a", load=1, slots=4)) == "a"  # home full
    # the least-loaded entry is full (4 of 4) but home has room (5 of 8): home keeps it
    assert routed(Load("h", load=5, slots=8), Load("a", load=4, slots=4)) == "h"
    assert full(Load("x", load=4, slots=4)) and not full(Load("x", load=3, slots=4))
    assert not full(Load("x", load=10_000))  # slots unknown: never full


def test_a_prefill_home_keeps_its_turn_while_a_decode_instance_accepts() -> None:
    prompt, prefix = turn(262)
    loads = [Load("p0", Role.PREFILL, load=3), Load("p1", Role.PREFILL), Load("d", Role.DECODE)]
    queues = {"p0": returning_turns(2), "p1": idle(), "d": decoding(40)}
    engines = [engine()]
    route_p0 = route_turn(
        prompt, 262, candidates(loads), loads[0], prefix, queues.__getitem__, engines
    )
    assert route_p0 == "p0"
    queues["p0"] = fresh_prompts(6)
    route_p1 = route_turn(
        prompt, 262, candidates(loads), loads[0], prefix, queues.__getitem__, engines
    )
    assert route_p1 == "p1"


# --- least loaded, prefill -> decode -------------------------------------------------------


def test_least_loaded_breaks_ties_by_worker_id_whatever_the_order() -> None:
    views = [Load("w2", load=2), Load("w1", load=2), Load("w3", load=2), Load("w9", load=4)]
    for order in itertools.permutations(views):
        best = least_loaded(order)
        assert best is not None and best.worker_id == "w1"
    assert least_loaded([]) is None


def test_least_loaded_weighs_each_load_by_the_instance_busy_time_per_turn() -> None:
    """A five times faster instance takes turns until what it holds, and the turn, take as
    long as a turn on the slow one; without the times, loads compare as counts."""

    def best(*views: Load) -> str | None:
        view = least_loaded(views)
        return view.worker_id if view is not None else None

    slow = Load("a", load=0, turn_s=1.0)
    assert best(slow, Load("b", load=3, turn_s=0.2)) == "b"  # 4 x 0.2 s < 1 x 1 s
    assert best(slow, Load("b", load=5, turn_s=0.2)) == "a"  # 6 x 0.2 s > 1 s
    assert best(Load("a"), Load("b", load=3)) == "a"
    # crowded and full still rank after every instance with room, however fast
    assert best(Load("a", load=50, turn_s=1.0), Load("b", load=1, kv_slots=1, turn_s=0.01)) == "a"
    assert best(Load("a", load=50, turn_s=1.0), Load("b", load=1, slots=1, turn_s=0.01)) == "a"


def test_an_h800_of_four_gpus_turns_the_shipped_workload_faster_than_an_h20() -> None:
    """The shipped workload's turn is mostly prefill, three times slower on an H20 than
    on an H800 per GPU, while their decode is alike: counted alone, an instance of four
    H800s took as many turns as one H20 (``docs/simulator.md``, "Routing")."""
    workload = load_profile("qwen3-8b").workload.model_copy(
        update={"prompt_tokens": PROMPT_TOKENS, "observation_tokens_per_turn": OBSERVATION_TOKENS}
    )

    def busy_s(gpu_type: str, tp: int, role: Role = Role.COLOCATED) -> float:
        return turn_work_s(engine(gpu_type, tp), role, workload, kv=10_000)

    assert busy_s("h20", 1) > 4 * busy_s("h800", 4)
    assert busy_s("h20", 1) > 1.5 * busy_s("h800", 1)
    for gpu_type, tp in (("h20", 1), ("h800", 4)):
        parts = busy_s(gpu_type, tp, Role.PREFILL) + busy_s(gpu_type, tp, Role.DECODE)
        assert busy_s(gpu_type, tp) == pytest.approx(parts)
    # the decode batch is the slots the KV cache holds when they are fewer
    assert turn_work_s(engine(), Role.DECODE, workload, kv=4) > busy_s("h20", 1, Role.DECODE)


def test_handoffs_go_to_the_least_loaded_accepting_decode_instance() -> None:
    views = [
        Load("c", Role.COLOCATED, load=0),
        Load("p", Role.PREFILL, load=0),
        Load("d0", Role.DECODE, accepting=False, load=0),  # draining
        Load("d2", Role.DECODE, load=3),
        Load("d1", Role.DECODE, load=3),
        Load("d3", Role.DECODE, load=7),
    ]
    assert route_decode(candidates(views)) == "d1"
    assert route_decode(candidates(views[:3])) is None


# --- the shortcut gives the rule's answer --------------------------------------------------

roles = st.sampled_from([Role.COLOCATED, Role.PREFILL, Role.DECODE])
engines_st = st.sampled_from([("h20", 1), ("h20", 2), ("h800", 2)])


@st.composite
def fleets(draw: st.DrawFn) -> tuple[list[Load], dict[str, InstanceQueue], Load | None]:
    n = draw(st.integers(1, 6))
    loads = [
        Load(f"w{i}", draw(roles), draw(st.booleans()), draw(st.integers(0, 8))) for i in range(n)
    ]
    queues = {}
    for v in loads:
        tokens = draw(st.integers(0, 60_000))
        decoding_seqs = draw(st.integers(0, 256))
        queues[v.worker_id] = InstanceQueue(
            engine(*draw(engines_st)),
            tokens,
            attention_pairs(tokens, draw(st.integers(0, 20_000))),
            decoding_seqs,
            decoding_seqs * draw(st.integers(1, 30_000)),
            decoding_seqs + draw(st.integers(0, 40)),
        )
    home = draw(st.none() | st.sampled_from(loads))
    return loads, queues, home


@settings(max_examples=300, deadline=None)
@given(
    fleet=fleets(),
    prompt=st.integers(1, 30_000),
    share=st.floats(0.0, 1.0),
    output=st.floats(0.0, 2000.0),
)
def test_the_search_shortcut_never_changes_the_route(
    fleet: tuple[list[Load], dict[str, InstanceQueue], Load | None],
    prompt: int,
    share: float,
    output: float,
) -> None:
    loads, queues, home = fleet
    prefix = int(prompt * share)
    all_engines = {q.engine for q in queues.values()}
    fast = route_turn(
        prompt, output, candidates(loads), home, prefix, queues.__getitem__, all_engines
    )
    full = route_turn(prompt, output, candidates(loads), home, prefix, queues.__getitem__)
    assert fast == full
    entries = candidates(loads).entry_ids
    assert (full is None) == (not entries)
    assert full is None or full in entries


def test_the_least_loaded_rule_ranks_instances_with_room_first() -> None:
    """Room in the KV cache first, then crowded instances (their trajectories fill it: a
    turn more evicts a prefix), then full ones: a one-H20 instance with KV for 2 contexts,
    holding 2, ranks after a four-H800 one holding 5 of its 8."""
    small, big = Load("a", load=2, kv_slots=2), Load("b", load=5, kv_slots=8)
    assert least_loaded([small, big]) is big
    crowded = Load("b", load=8, kv_slots=8)
    assert least_loaded([small, crowded]) is small  # both crowded: the fewest
    assert least_loaded([Load("a", load=1, slots=1), crowded]) is crowded  # full after crowded
    assert not full(crowded)  # crowded still takes turns: a recompute, not a stall


def test_an_instances_kv_slots_are_the_contexts_its_kv_holds() -> None:
    assert kv_slots(217_000, 8_000.0) == 27  # a 30B model on one H20
    assert kv_slots(1_000, 8_000.0) == 1  # at least one
    defaults = load_profile("qwen3-8b").workload
    expected = defaults.prompt_tokens + (defaults.turns_per_trajectory - 1) / 2 * (
        defaults.observation_tokens_per_turn + defaults.output_tokens_per_turn
    )
    assert mean_context_tokens(defaults) == pytest.approx(
        expected + defaults.output_tokens_per_turn / 2
    )
