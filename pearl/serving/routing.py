"""The routing rules: which instance a turn goes to, and which takes a prefill's KV.

Pure functions over ``pearl.serving.views`` (what a router knows of each instance); the
simulator's fleet builds the views from its engines, the HTTP router will build them from
its own bookkeeping. Worker ids are returned, ``None`` when no instance can take the
request (the caller parks it until one joins).

**Candidates** (``candidates``): the accepting instances a turn may start on (*entries*:
colocated ones, and prefill ones while some decode instance accepts, to take their KV)
and the accepting decode instances. They change only when an instance joins, leaves or
stops accepting, so a router keeps them between those changes.

**Least loaded** (``least_loaded``): the least time to serve the requests running,
waiting and incoming and one turn more, the load weighed by the instance's busy time per
turn of the workload's mean shape (``turn_work_s``; the count where that is not known);
ties go to the smallest worker id, so a route is deterministic. Equal instances rank by
their loads; of unequal ones, the faster takes more turns. The rules scan the
candidates for it unless given a ``LoadOrder`` that keeps it as loads change (the
simulator's fleet does: ``pearl.serving.load_index``).

**Full instances** (``full``): an instance holding as many requests as it runs at once
(its ``slots``, vLLM's ``max_num_seqs``) takes no more turns: one more would only queue
there. A turn whose home and least-loaded entry are both full is parked (None), and routed
again once an entry has room. Without it, every turn parked while no instance served went
to the first instances that joined, queues of hundreds each that instances joining
seconds later never shared (turns return to their home).

**Crowded instances**: one whose trajectories fill its KV cache (its ``kv_slots``: the
workload's contexts it holds, ``kv_slots()``) ranks after every instance with room in the
least-loaded rule (``views.load_rank``), but still takes turns: a turn more evicts a
prefix one of its trajectories comes back to, which costs a recompute, not a stall.
Counted alone, an instance with KV for a few dozen contexts (a 30B model on one H20) took
as many trajectories as one with room for hundreds (``docs/simulator.md``, "Routing").

**Prefill -> decode** (``route_decode``): a prefill instance's KV handoff goes to the
least-loaded decode instance.

**Cost-aware prefix affinity** (``route_turn``). A returning turn's prompt begins with the
whole context of its trajectory's previous turn, which the instance that served that turn
(its *home*) holds in its prefix cache; anywhere else that prefix is computed again. A
first turn, or one whose home left or stopped accepting, goes to the least-loaded entry.
Otherwise the turn stays home unless what it costs there exceeds what it costs on the
least-loaded entry (the *alternative*): its own expected time to finish, plus the delay
its prompt adds to the sequences decoding there:

    stay  <=>  T(home, prefix cached) + S(home, prefix cached)
               <=  T(alternative, nothing cached) + S(alternative, nothing cached)
    T = wait + prefill(prompt beyond the cached prefix) + expected output * token time
    S = sequences decoding there * prefill(prompt beyond the cached prefix) alone

(``pearl.serving.costs``): ``wait`` is the prefill queued ahead of the turn beside the
instance's decoding batch (``expected_wait_s``); ``prefill`` the turn's own prompt at that
instance's coefficients; ``token time`` the decode step of the batch the turn joins there
(everything the instance holds or will hold, and the turn), or, for a prefill instance,
on the decode instance its KV goes to; the expected output is the mean of the turns
finished so far (a router does not know a turn's length in advance); ``S`` is
``costs.stall_s``: the steps carrying the prompt's chunks carry the decode of the
instance's batch too, each of its sequences waiting for the chunks. Ties stay home.

Read with equal engines: stay unless the queue ahead at home, plus the slower decode of
a bigger batch there, costs more than recomputing the prefix elsewhere plus the queue
there. The two halves weigh what the rule it replaces got wrong in both directions. It
left home whenever home had anything queued; a returning turn's prefix is most of its
prompt (the shipped workload: a 5,330-token prompt and ~880 tokens more per turn, a few
hundred new), so leaving turned a short wait behind a neighbour's chunk into a recompute
of thousands of tokens, which lengthened the queues that made the next turns leave: with
27.9 output tokens per turn, where queues are nearly always non-empty, 78% of returning
turns lost their prefix and roll-fixed fell from 24,540 to 14,052 traj/h (600 s of the
shipped Qwen3-8B scenario). Never leaving is no better: at the shipped output lengths
trajectories pile up on some instances while others idle, and instances that join (lent
trainer GPUs, elastic ones) get only first turns; keeping every turn home gave roll-fixed
18,866 traj/h there against the old rule's 24,574 (1,800 s). Weighing the recompute
against the wait and the decode keeps turns home while their queue is short and their
batch like the others, and moves them where an instance has room (``docs/simulator.md``,
"Routing", has the figures).

``S`` is the part of the rule that is not greedy. Without it a recompute elsewhere was
weighed by the turn's own time alone, while its thousands of tokens held up every
sequence decoding there: on the Qwen3-8B paper scenario the routing rule moved a sixth
of the returning turns, their recomputes more tokens than the hits computed
(``benchmarks/turn_prefill.py``; ``docs/simulator.md``, "Routing", has the figures with
and without it).

What the rule does not weigh: the recompute delays the requests that queue behind it
(they are admitted later); a turn's decode slows the batch it joins (weighing that too
gave nothing on the four shipped scenarios); the prefix may have been evicted at home
(the router counts what it sent); requests in flight to an instance count in its batch
but not in its queue; the KV transfer of a disaggregated turn.

Invariants: every returned id is of an accepting instance among the candidates, an entry
for a turn and a decode instance for a handoff; no turn goes to a full instance; a turn
with no home, or whose home is not an entry any more or is full, goes to the least-loaded
entry unless that is full; the same inputs give the same id; the
search shortcut (``engines``) never changes the answer.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Protocol

from pearl.core.profile import EngineProfile, WorkloadDefaults
from pearl.core.roles import Role
from pearl.serving.costs import (
    fastest_prompt_s,
    fastest_token_s,
    prompt_ready_s,
    stall_s,
    turn_s,
)
from pearl.serving.views import InstanceLoad, InstanceQueue, full, load_rank


@dataclass(frozen=True, slots=True)
class Candidates:
    """The accepting instances by what they may take: entries (a turn may start there)
    and decode instances (a prefill's KV may go there), each as given (live views: their
    loads are read at every route). Valid until an instance joins, leaves or stops
    accepting; a router keeps one between those changes."""

    entries: tuple[InstanceLoad, ...]
    decodes: tuple[InstanceLoad, ...]
    entry_ids: frozenset[str]

    def least_loaded_entry(self) -> InstanceLoad | None:
        return least_loaded(self.entries)

    def least_loaded_decode(self) -> InstanceLoad | None:
        return least_loaded(self.decodes)


class LoadOrder(Protocol):
    """The least-loaded entry and decode instance of a ``Candidates`` (``least_loaded``'s
    rule). ``Candidates`` itself scans them; a router with many instances may keep them
    as loads change instead (``pearl.serving.load_index.CandidateLoads``)."""

    def least_loaded_entry(self) -> InstanceLoad | None: ...

    def least_loaded_decode(self) -> InstanceLoad | None: ...


def candidates(loads: Iterable[InstanceLoad]) -> Candidates:
    """Entries: the accepting colocated instances, and the accepting prefill ones while
    some decode instance accepts; decodes: the accepting decode instances."""
    accepting = [v for v in loads if v.accepting]
    decodes = tuple(v for v in accepting if v.role is Role.DECODE)
    roles = _ENTRY_WITH_DECODE if decodes else _ENTRY
    entries = tuple(v for v in accepting if v.role in roles)
    return Candidates(entries, decodes, frozenset(v.worker_id for v in entries))


_ENTRY = frozenset({Role.COLOCATED})
_ENTRY_WITH_DECODE = frozenset({Role.COLOCATED, Role.PREFILL})


def kv_slots(kv_capacity_tokens: int, context_tokens: float) -> int:
    """The contexts of ``context_tokens`` an instance's KV cache holds
    (``InstanceLoad.kv_slots``; at least one)."""
    return max(1, int(kv_capacity_tokens // max(context_tokens, 1.0)))


def mean_context_tokens(defaults: WorkloadDefaults) -> float:
    """A live trajectory's context, averaged over its turns: the prompt, half the turns'
    observations and outputs before it, half the turn's own output."""
    before = (defaults.turns_per_trajectory - 1.0) / 2.0
    per_turn = defaults.observation_tokens_per_turn + defaults.output_tokens_per_turn
    return defaults.prompt_tokens + before * per_turn + defaults.output_tokens_per_turn / 2.0


def turn_work_s(engine: EngineProfile, role: Role, defaults: WorkloadDefaults, kv: int) -> float:
    """An instance's busy time per turn of the workload's mean shape (``InstanceLoad.turn_s``).

    Prefill (colocated and prefill instances): a trajectory's prompt spread over its
    turns, and each later turn's observation after its cached context
    (``mean_context_tokens``). Decode (colocated and decode instances): the turn's output
    at a full batch's step time per sequence, the batch ``max_num_seqs`` or the ``kv``
    contexts its KV cache holds, whichever is fewer."""
    ctx = mean_context_tokens(defaults)
    turns = defaults.turns_per_trajectory
    busy_s = 0.0
    if role is not Role.DECODE:
        prompt_s = float(engine.prefill.work_s(defaults.prompt_tokens))
        later_s = float(engine.prefill.work_s(defaults.observation_tokens_per_turn, ctx))
        busy_s += (prompt_s + (turns - 1.0) * later_s) / turns
    if role is not Role.PREFILL:
        batch = max(1, min(engine.max_num_seqs, kv))
        step_s = float(engine.decode.step_s(batch, batch * ctx))
        busy_s += defaults.output_tokens_per_turn * step_s / batch
    return busy_s


def least_loaded(loads: Iterable[InstanceLoad]) -> InstanceLoad | None:
    """The least time to serve its load and one turn more among the instances with room
    in their KV cache, then among the crowded ones, then among the full ones
    (``views.load_rank``); ties to the smallest worker id; None for no instance."""
    return min(loads, key=_load_key, default=None)


def _load_key(view: InstanceLoad) -> tuple[float, str]:
    return load_rank(view), view.worker_id


def route_turn(
    prompt_tokens: int,
    output_tokens: float,
    among: Candidates,
    home: InstanceLoad | None,
    prefix_tokens: int,
    queue_of: Callable[[str], InstanceQueue],
    engines: Collection[EngineProfile] = (),
    order: LoadOrder | None = None,
) -> str | None:
    """The instance a turn of ``prompt_tokens`` and about ``output_tokens`` output goes
    to, or None (park it).

    ``home`` is the instance the router last sent this trajectory to, with
    ``prefix_tokens`` of it cached there (None for a trajectory's first turn; no other
    instance is taken to cache any of it); ``queue_of(worker_id)`` builds the queue view of
    one instance, called for the home, the alternative and, when either is a prefill
    instance, the decode instance its KV would go to. ``engines``, when given, holds the
    engine profiles of every candidate (a superset will do): a home whose expected turn
    beats the fastest any of them could do recomputing the whole prompt, alone, keeps the
    turn without the search for the alternative (the same answer, since no alternative can
    do better). ``order``, when given, finds the least-loaded entry and decode instance
    of ``among`` (it must agree with ``among``'s own scan).
    """
    if order is None:
        order = among
    home_s: float | None = None
    is_home = home is not None and home.worker_id in among.entry_ids and not full(home)
    if home is not None and is_home and home.role is Role.COLOCATED and engines:
        home_s = _turn_s(home, prefix_tokens, prompt_tokens, output_tokens, queue_of, None)
        floor_s = fastest_prompt_s(engines, prompt_tokens)
        floor_s += output_tokens * fastest_token_s(engines, prompt_tokens)
        if home_s <= floor_s:
            return home.worker_id
    alternative = order.least_loaded_entry()
    if alternative is not None and full(alternative):
        alternative = None  # the least loaded is full: no entry has room for it
    if alternative is None:
        return home.worker_id if home is not None and is_home else None
    if home is None or not is_home or home.worker_id == alternative.worker_id:
        return alternative.worker_id
    decode_id = None
    if home.role is Role.PREFILL or alternative.role is Role.PREFILL:
        decode_id = route_decode(among, order)
    if home_s is None:
        home_s = _turn_s(home, prefix_tokens, prompt_tokens, output_tokens, queue_of, decode_id)
    alternative_s = _turn_s(alternative, 0, prompt_tokens, output_tokens, queue_of, decode_id)
    return home.worker_id if home_s <= alternative_s else alternative.worker_id


def _turn_s(
    entry: InstanceLoad,
    prefix_tokens: int,
    prompt_tokens: int,
    output_tokens: float,
    queue_of: Callable[[str], InstanceQueue],
    decode_id: str | None,
) -> float:
    """What a turn costs on an entry instance: its expected time, decoded there when
    colocated, on the decode instance a prefill's KV goes to (``decode_id``) otherwise,
    plus its prompt's stall of the batch decoding on the entry (``costs.stall_s``)."""
    queue = queue_of(entry.worker_id)
    ready_s = prompt_ready_s(queue, prompt_tokens, prefix_tokens)
    stalled_s = stall_s(queue, prompt_tokens, prefix_tokens)
    if entry.role is Role.PREFILL and decode_id is not None:
        return stalled_s + turn_s(ready_s, queue_of(decode_id), prompt_tokens, output_tokens)
    return stalled_s + turn_s(ready_s, queue, prompt_tokens, output_tokens)


def route_decode(among: Candidates, order: LoadOrder | None = None) -> str | None:
    """The decode instance a prefill's KV goes to: the least-loaded accepting one."""
    best = (order if order is not None else among).least_loaded_decode()
    return best.worker_id if best is not None else None
