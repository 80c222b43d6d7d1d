"""The router: each turn of each trajectory to the instances of the current PD configuration.

``Router.generate(turn)`` sends one turn and returns its output (token ids, logprobs, the
weight version of every token, where it ran). Where it goes is ``pearl.serving.routing``'s
rule over the router's :class:`~pearl.router.instances.InstanceTable`:

- **colocated**: one ``POST /v1/completions`` on an entry instance, the trajectory's
  *home* (the instance that holds its prefix) unless the cost-aware rule finds a better
  one (with an engine profile), or, without a profile, unless home is saturated
  (``max_seqs_per_instance`` in flight) — then the least loaded;
- **disaggregated**: the prefill on a prefill instance (``kv_transfer_params:
  {do_remote_decode: true}``, ``max_tokens: 1``, not streamed), then the decode on the
  least-loaded decode instance with the ``kv_transfer_params`` the prefill returned, both
  under one ``X-Request-Id`` — the calls and fields of vLLM's disaggregated proxy
  (``toy_proxy_server.py``; ``tests/router/test_pd_conformance.py`` checks them).

A turn whose request comes back aborted (a migration took it off its instance, a pause
with ``mode=abort``, a sleep) is continued: its prompt grows by the tokens generated so far,
its ``max_tokens`` shrinks by as many, and it is routed again, so no token is generated
twice and the turn's output is the concatenation. A turn with no instance to go to, or
whose every instance holds as many requests as its engine runs at once
(``pearl.serving.routing.full``), waits (parked) until the table changes or one of them
has room; a prefill that finds no decode instance accepting (a plan is changing the
pools) frees its held KV and the turn is routed again. An instance
that does not answer is skipped for that turn, which is routed again. Tries that bring no
token back the router backs off from (exponentially, up to 0.5 s), and gives the turn up
(``TurnFailed``) after ``MAX_FUTILE_TRIES`` of them in a row.

**Unequal instances.** With a runtime profile (``Router(profile=...)``) and each instance's
GPU type and TP degree (the plan step that started or woke it says them), the router
weighs each instance's load by its busy time per turn of the traffic's mean shape
(``Router.reweigh``: ``pearl.serving.routing.turn_work_s`` on the means of the turns it has
routed, ``pearl.serving.traffic``, the profile's until it has seen enough), the rule the
simulator's fleet follows: an instance that turns the workload five times faster takes
about five times the turns. Without them loads compare as counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from pearl.core.profile import EngineProfile, RuntimeProfile, WorkloadDefaults
from pearl.core.roles import Role
from pearl.engines.client import EngineClient, EngineError, EngineUnreachable
from pearl.router.instances import InFlight, Instance, InstanceTable
from pearl.serving.routing import (
    candidates,
    kv_slots,
    least_loaded,
    mean_context_tokens,
    route_decode,
    route_turn,
    turn_work_s,
)
from pearl.serving.traffic import TrafficMeans
from pearl.serving.views import full

PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True)
class Turn:
    traj_id: str
    prompt_ids: tuple[int, ...]
    sampling: Sampling
    turn_id: str = ""


@dataclass
class TurnOutput:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    served_by: list[str] = field(default_factory=list)  # where each request generated
    prefilled_by: list[str] = field(default_factory=list)  # prefill instances (disaggregated)
    continuations: int = 0  # requests resubmitted after an abort
    started_s: float = 0.0
    ended_s: float = 0.0

    def extend(self, choice: dict[str, Any], worker_id: str, version: int | None) -> int:
        ids = [int(t) for t in choice.get("token_ids") or []]
        lps = (choice.get("logprobs") or {}).get("token_logprobs") or [0.0] * len(ids)
        vers = choice.get("weight_versions") or [version or 0] * len(ids)
        self.token_ids += ids
        self.logprobs += [float(x) for x in lps]
        self.versions += [int(v) for v in vers]
        self.finish_reason = choice.get("finish_reason")
        self.served_by.append(worker_id)
        return len(ids)


class TurnFailed(RuntimeError):
    """A turn that made no progress over ``MAX_FUTILE_TRIES`` tries in a row (every
    instance unreachable, or each answer an abort without a token): the caller decides
    (the rollout manager ends the trajectory with this reason)."""


MAX_FUTILE_TRIES = 50
REWEIGH_EVERY_TURNS = 64  # finished turns between two updates of the instances' weights
CONTROL_TIMEOUT_S = 30.0  # an abort's or a scrape's answer
BACKOFF_S = (0.01, 0.5)  # the first wait after a futile try, and the longest


class Router:
    def __init__(
        self,
        table: InstanceTable | None = None,
        *,
        engine: EngineProfile | None = None,
        profile: RuntimeProfile | None = None,
        max_seqs_per_instance: int = 64,
        timeout_s: float = 600.0,
    ) -> None:
        self.table = table or InstanceTable()
        self.engine = engine
        self.profile = profile  # weighs unequal instances (the module docstring)
        self.traffic = TrafficMeans()
        self._context: dict[str, int] = {}  # traj -> its context after its last turn
        self.max_seqs_per_instance = max_seqs_per_instance
        self.timeout_s = timeout_s
        self.home: dict[str, tuple[str, int]] = {}  # traj -> (instance, cached prefix tokens)
        self._clients: dict[str, EngineClient] = {}  # url -> its generations' connections
        self._control: dict[str, EngineClient] = {}  # url -> its aborts' and scrapes'
        self._ids = itertools.count()
        self._output_tokens_sum = 0
        self._output_turns = 0

    async def aclose(self) -> None:
        for clients in (self._clients, self._control):
            for c in clients.values():
                await c.aclose()
            clients.clear()

    def client(self, inst: Instance) -> EngineClient:
        """The client of ``inst``'s generations (a pool of httpx's 100 connections: more
        requests wait in the pool)."""
        c = self._clients.get(inst.url)
        if c is None:
            c = self._clients[inst.url] = EngineClient(inst.url, timeout_s=self.timeout_s)
        return c

    def control(self, inst: Instance) -> EngineClient:
        """The client of ``inst``'s aborts and scrapes, pooled apart from its generations:
        an abort queued behind 100 generations that a sleeping engine holds would never
        be sent (tests/router/test_plan_steps.py, the sleep with 130 requests)."""
        c = self._control.get(inst.url)
        if c is None:
            c = self._control[inst.url] = EngineClient(inst.url, timeout_s=CONTROL_TIMEOUT_S)
        return c

    def forget(self, traj_id: str) -> None:
        """The trajectory has ended: its home is not needed any more."""
        self.home.pop(traj_id, None)
        self._context.pop(traj_id, None)

    # -- unequal instances ---------------------------------------------------------------

    def workload(self) -> WorkloadDefaults | None:
        """The traffic's mean shape (the profile's until enough turns); None: no profile."""
        if self.profile is None:
            return None
        return self.traffic.workload(self.profile.workload)

    def describe(self, worker_id: str, gpu_type: str | None, tp: int | None) -> None:
        """What ``worker_id`` runs on (a plan step says it), and every instance weighed
        again (``reweigh``)."""
        inst = self.table.get(worker_id)
        if gpu_type is not None:
            inst.gpu_type = gpu_type
        if tp is not None:
            inst.tp = tp
        self.reweigh()

    def reweigh(self) -> None:
        """Every instance's busy time per turn of the traffic's mean shape
        (``Instance.turn_s``), as the simulator's fleet computes it, from the profile's
        engine for what it runs on. Loads compare in one unit: while any instance cannot
        be weighed (no profile, no engine for what it runs on, or a GPU type no step
        named) none is (counts), rather than a count beside a time."""
        workload = self.workload()
        weights = [_turn_s(inst, self.profile, workload) for inst in self.table]
        known = all(w is not None for w in weights)
        for inst, weight in zip(self.table, weights, strict=True):
            inst.turn_s = weight if known else None

    # -- routing -----------------------------------------------------------------------

    @property
    def turns_done(self) -> int:
        return self._output_turns

    @property
    def expected_output_tokens(self) -> float:
        if not self._output_turns:
            return 256.0
        return self._output_tokens_sum / self._output_turns

    def _choose(self, traj_id: str, prompt_tokens: int, skip: set[str]) -> Instance | None:
        among = self.table.candidates()
        if skip:
            among = candidates(i for i in self.table if i.worker_id not in skip)
        entries = among.entries
        if not entries:
            return None
        home_id, cached = self.home.get(traj_id, (None, 0))
        home = self.table.get(home_id) if home_id is not None and home_id in self.table else None
        if home is not None and (home.worker_id in skip or home.worker_id not in among.entry_ids):
            home = None  # gone, draining, failed this turn, or no entry now (a decode one)
        if self.engine is not None:
            engine = self.engine
            wid = route_turn(
                prompt_tokens,
                self.expected_output_tokens,
                among,
                home,
                cached,
                lambda w: self.table.get(w).queue(engine),
            )
            return self.table.get(wid) if wid is not None else None
        if home is not None and home.load < self.max_seqs_per_instance and not full(home):
            return home
        best = least_loaded(entries)
        if best is not None and full(best):  # the least loaded is full: none has room
            return home if home is not None and not full(home) else None
        return self.table.get(best.worker_id) if best is not None else None

    async def _entry(self, traj_id: str, prompt_tokens: int, skip: set[str]) -> Instance:
        while True:
            changed = self.table.changed
            inst = self._choose(traj_id, prompt_tokens, skip)
            if inst is not None:
                return inst
            if skip:  # every other instance failed this turn: try them all again
                skip.clear()
                continue
            await changed.wait()  # parked until an instance joins, comes back or has room

    # -- one turn ----------------------------------------------------------------------

    def _body(self, turn: Turn, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        s = turn.sampling
        body: dict[str, Any] = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "logprobs": 0,
            "return_token_ids": True,
            "ignore_eos": s.ignore_eos,
        }
        if s.seed is not None:
            body["seed"] = s.seed
        if s.stop_token_ids:
            body["stop_token_ids"] = list(s.stop_token_ids)
        return body

    def _request_id(self, turn: Turn) -> str:
        return f"{turn.turn_id or turn.traj_id}-{next(self._ids)}"

    async def _send(
        self,
        inst: Instance,
        turn: Turn,
        body: dict[str, Any],
        cached: int,
        rid: str | None = None,
    ) -> dict[str, Any]:
        rid = rid or self._request_id(turn)
        inst.sent(InFlight(rid, turn.traj_id, len(body["prompt"]), cached))
        try:
            return await self.client(inst).completions(body, request_id=rid)
        finally:
            inst.returned(rid)
            if inst.slots is not None and inst.load == inst.slots - 1:
                self.table.wake()  # it was full: a parked turn may go there now

    async def generate(self, turn: Turn) -> TurnOutput:
        """The turn's output; ``TurnFailed`` if it stops making progress (see there)."""
        out = TurnOutput(started_s=time.monotonic())
        skip: set[str] = set()
        futile = 0
        self.traffic.turn_routed(len(turn.prompt_ids), self._context.get(turn.traj_id))
        while True:
            prompt = [*turn.prompt_ids, *out.token_ids]
            left = turn.sampling.max_tokens - len(out.token_ids)
            entry = await self._entry(turn.traj_id, len(prompt), skip)
            home_id, cached = self.home.get(turn.traj_id, (None, 0))
            cached = cached if home_id == entry.worker_id else 0
            try:
                if entry.role is Role.PREFILL and left > 1:
                    got = await self._disaggregated(entry, turn, prompt, left, cached, out)
                else:  # colocated (a prefill instance serves one token as well)
                    resp = await self._send(entry, turn, self._body(turn, prompt, left), cached)
                    got = out.extend(resp["choices"][0], entry.worker_id, entry.weight_version)
                    self.home[turn.traj_id] = (entry.worker_id, len(prompt) + max(0, got - 1))
            except EngineUnreachable:
                skip.add(entry.worker_id)
                got, out.finish_reason = 0, "abort"
            if len(out.token_ids) >= turn.sampling.max_tokens and out.finish_reason == "abort":
                out.finish_reason = "length"  # aborted just as it was done
            if out.finish_reason == "abort":
                futile = 0 if got else futile + 1
                if futile >= MAX_FUTILE_TRIES:
                    raise TurnFailed(
                        f"turn {turn.turn_id or turn.traj_id}: no progress in "
                        f"{futile} tries (instances unreachable or aborting)"
                    )
                if futile:
                    await asyncio.sleep(min(BACKOFF_S[1], BACKOFF_S[0] * 2 ** (futile - 1)))
                out.continuations += 1
                continue  # taken off its instance: the rest of the turn goes elsewhere
            out.ended_s = time.monotonic()
            self._output_tokens_sum += len(out.token_ids)
            self._output_turns += 1
            self._context[turn.traj_id] = len(turn.prompt_ids) + len(out.token_ids)
            self.traffic.turn_finished(len(out.token_ids))
            if self.profile is not None and self._output_turns % REWEIGH_EVERY_TURNS == 0:
                self.reweigh()
            return out

    async def _disaggregated(
        self,
        prefill: Instance,
        turn: Turn,
        prompt: list[int],
        left: int,
        cached: int,
        out: TurnOutput,
    ) -> int:
        """Prefill on ``prefill``, decode where its KV goes; the tokens added to ``out``."""
        body = self._body(turn, prompt, 1)
        body["kv_transfer_params"] = dict(PREFILL_PARAMS)
        prefill_rid = self._request_id(turn)
        resp = await self._send(prefill, turn, body, cached, prefill_rid)
        self.home[turn.traj_id] = (prefill.worker_id, len(prompt))
        out.prefilled_by.append(prefill.worker_id)
        params = resp.get("kv_transfer_params")
        choice = resp["choices"][0]
        if not params or choice.get("finish_reason") != "length":
            # the prefill's one token ended the turn (a stop), or it was aborted: that is
            # the turn's output so far
            return out.extend(choice, prefill.worker_id, prefill.weight_version)
        decode_id = route_decode(self.table.candidates())
        if decode_id is None:
            # no decode instance now (a plan is changing the pools): free the KV held for
            # one and route the turn again
            with contextlib.suppress(EngineError):
                await self.control(prefill).abort_requests([prefill_rid])
            out.finish_reason = "abort"
            return 0
        decode = self.table.get(decode_id)
        body = self._body(turn, prompt, left)
        body["kv_transfer_params"] = params
        try:
            # the prefill's request id, as vLLM's proxy: a NixlConnector that returns no
            # remote_request_id (before vLLM PR 29665) names the KV it has read, for the
            # producer to free, by the decode's own request id
            resp = await self._send(decode, turn, body, len(prompt), prefill_rid)
        except EngineError as err:
            if err.status != 400 or "kv_transfer_params" not in err.message:
                raise
            # the KV could not be pulled (the lease expired, the producer went away or
            # slept): the next attempt prefills again
            out.finish_reason = "abort"
            return 0
        return out.extend(resp["choices"][0], decode.worker_id, decode.weight_version)

    # -- plan steps that touch traffic ------------------------------------------------

    async def drain(self, worker_id: str, timeout_s: float | None = None) -> None:
        """No new turns to ``worker_id``; returns once its requests in flight are back."""
        inst = self.table.drain(worker_id)
        await asyncio.wait_for(inst.idle.wait(), timeout_s)

    async def migrate(self, worker_id: str, timeout_s: float | None = None) -> int:
        """Drain ``worker_id`` and abort its requests in flight: each comes back with its
        tokens so far and :meth:`generate` continues it elsewhere. The requests aborted."""
        return await self.abort_in_flight(self.table.drain(worker_id), timeout_s)

    async def abort_in_flight(self, inst: Instance, timeout_s: float | None = None) -> int:
        """Abort ``inst``'s requests in flight until none is left (it takes no new ones:
        draining, switching or out of the table); each comes back with its tokens so far
        and :meth:`generate` continues it elsewhere. The requests aborted."""
        aborted: set[str] = set()

        async def abort_until_idle() -> None:
            # a request still on its way (sent, not yet on the engine) is missed by one
            # abort: repeat until every request has come back
            while inst.in_flight:
                ids = list(inst.in_flight)
                aborted.update(ids)
                with contextlib.suppress(EngineError):
                    await self.control(inst).abort_requests(ids)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(inst.idle.wait(), 0.2)

        await asyncio.wait_for(abort_until_idle(), timeout_s)
        return len(aborted)

    async def scrape(self) -> None:
        """Read every instance's ``/metrics`` once (queue, KV usage, weight version)."""

        async def one(inst: Instance) -> None:
            try:
                m = await self.control(inst).metrics()
            except EngineError:
                return
            inst.scraped_waiting = int(m.get("vllm:num_requests_waiting", 0))
            inst.scraped_running = int(m.get("vllm:num_requests_running", 0))
            inst.kv_usage = float(m.get("vllm:kv_cache_usage_perc", 0.0))
            if "pearl:weight_version" in m:
                inst.weight_version = int(m["pearl:weight_version"])

        await asyncio.gather(*(one(i) for i in list(self.table)))

    async def scrape_forever(self, interval_s: float = 1.0) -> None:
        while True:
            await self.scrape()
            await asyncio.sleep(interval_s)


def _turn_s(
    inst: Instance, profile: RuntimeProfile | None, workload: WorkloadDefaults | None
) -> float | None:
    """``routing.turn_work_s`` of ``inst`` (``Router.reweigh``): its engine, or the
    profile's for its GPU type and TP degree; its KV slots the profile's. Only the weight:
    the router does not take the profile's ``max_num_seqs`` or KV capacity as the
    instance's own (``full`` and crowded stay off without an engine given; docs/router.md
    says why)."""
    if profile is None or workload is None or not inst.gpu_type:
        return None
    tp = inst.tp or 1
    engine = inst.engine or profile.engine(inst.gpu_type, tp)
    if engine is None:
        return None
    kv = kv_slots(profile.kv_capacity_tokens(inst.gpu_type, tp), mean_context_tokens(workload))
    return turn_work_s(engine, inst.role, workload, kv)
