"""Per-trajectory lower bounds for the first-completed oracle: time and GPU-seconds.

A trajectory's *own time* is a lower bound of its wall time from admission to finish in any
run; its *work* a lower bound of the GPU-seconds its tokens take. Both count each turn's
context (the engine's cost model, ``pearl.core.profile``, in the simulator's use of it,
``pearl.sim.engine``), and both take, for every part, the cheapest engine of the GPU types
given:

- **Prefill** of turn ``i``: ``n`` new tokens (the prompt for turn 0, the observation
  after) end a context of ``C`` tokens (``prompt + sum(new[:i+1]) + sum(output[:i])``).
  The cached prefix is at most ``C - n`` (the new tokens were never seen), so the
  attention term is at least ``c * (C**2 - (C - n)**2)`` however the prompt is chunked.
  Time: ``a + b n + c (C**2 - (C - n)**2)`` (one chunk, nothing else batched); work:
  ``tp (b n + c (...))`` (the step's fixed ``a`` is shared by its batch).
- **Decode**: the ``k``-th output token of the turn is decoded at a context of ``C + k``
  tokens. A step of ``B`` sequences holding ``K >= C + k`` tokens lasts
  ``base + per_seq B + per_ctx K``: at least ``base + per_seq B_min + per_ctx (C + k)``
  with ``B_min`` the regime's smallest batch; and of its ``tp x step`` GPU-seconds this
  sequence's share (fixed cost split over at most the regime's largest batch) is at least
  ``tp (base / B_max + per_seq + per_ctx (C + k))``. Per token the bound is the lower
  envelope of these lines over engines and regimes (``Lines``), summed exactly over the
  token's contexts.
- **Tools**: the tool latencies, exactly; they take no GPU.
- **Blended** (F8 of ``pearl.sim.oracle``): per price ``mu`` (GPUs per second in flight),
  GPU-seconds plus ``mu`` x the seconds in flight a trajectory adds to the sum over its
  steps' accepted sequences. A decode step whose ``m`` accepted sequences hold contexts
  ``C_i`` lasts at least ``fixed + per_seq m + per_ctx sum(C_i)`` (``_shared_steps``: in
  the large regime the step holds at least ``large_batch_from``), so each token adds at
  least ``fixed + m (per_seq + per_ctx C)`` seconds in flight and ``tp (fixed / m +
  per_seq + per_ctx C)`` GPU-seconds; the least over real ``m`` in range is concave in
  ``C``, so its table's interpolation and the chord over a turn's contexts are below it.
  A prefill chunk adds ``tp (b n + c q)`` and ``a + b n + c q``; a tool its latency.

Every term is a cost the engine model charges at least once (preemption, migration,
re-prefill after an interruption and transfers only add), so the sums are lower bounds.
Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import reduce
from itertools import chain

import numpy as np
from numpy.typing import NDArray

from pearl.core.profile import EngineProfile
from pearl.sim.trajectories import TrajectorySpec

F64 = NDArray[np.float64]


@dataclass(frozen=True)
class Lines:
    """The lower envelope of cost lines ``c0 + c1 L`` over contexts ``L >= 0``.

    Invariants: ``starts_tokens[0] == 0``, strictly increasing integer starts; piece ``k``
    is the minimum of every line for integer contexts in ``[starts[k], starts[k + 1])``.
    """

    starts_tokens: tuple[int, ...]
    c0: tuple[float, ...]
    c1: tuple[float, ...]

    @staticmethod
    def envelope(lines: Sequence[tuple[float, float]]) -> Lines:
        if not lines:
            raise ValueError("no cost lines")
        pairs = sorted(set(lines), key=lambda p: (p[0], p[1]))
        cur = pairs[0]  # the least at L = 0 (then the flattest)
        starts, c0s, c1s = [0], [cur[0]], [cur[1]]
        while True:
            crossings = [
                ((c0 - cur[0]) / (cur[1] - c1), c1, c0)
                for c0, c1 in pairs
                if c1 < cur[1] and c0 >= cur[0]
            ]
            if not crossings:
                break
            at_tokens, c1, c0 = min(crossings)
            start = max(int(np.ceil(at_tokens)), starts[-1] + 1)
            cur = (c0, c1)  # strictly flatter than the last: the loop ends
            starts.append(start)
            c0s.append(c0)
            c1s.append(c1)
        return Lines(tuple(starts), tuple(c0s), tuple(c1s))

    def at(self, ctx_tokens: float) -> float:
        """The envelope at one context (every line is at least this there)."""
        return min(c0 + c1 * ctx_tokens for c0, c1 in zip(self.c0, self.c1, strict=True))

    def token_sums(self, first_ctx_tokens: F64, num_tokens: F64) -> F64:
        """Per row, the sum of the envelope over contexts ``first .. first + num - 1``."""
        total = np.zeros_like(first_ctx_tokens)
        ends = (*self.starts_tokens[1:], np.inf)
        for lo, hi, c0, c1 in zip(self.starts_tokens, ends, self.c0, self.c1, strict=True):
            a = np.maximum(first_ctx_tokens, lo)
            b = np.minimum(first_ctx_tokens + num_tokens, hi)
            n = np.maximum(b - a, 0.0)
            total += n * c0 + c1 * n * (a + b - 1.0) / 2.0
        return total


def _decode_lines(engines: Sequence[EngineProfile]) -> tuple[Lines, Lines]:
    """(seconds per token, GPU-seconds per token) envelopes over engines and regimes."""
    time_lines: list[tuple[float, float]] = []
    work_lines: list[tuple[float, float]] = []
    for e in engines:
        d = e.decode
        small_max = min(d.large_batch_from - 1, e.max_num_seqs)
        if small_max >= 1:
            r = d.small
            time_lines.append((r.base_s + r.per_seq_s, r.per_ctx_token_s))
            work_lines.append(
                (e.tp * (r.base_s / small_max + r.per_seq_s), e.tp * r.per_ctx_token_s)
            )
        if e.max_num_seqs >= d.large_batch_from:
            r = d.large
            time_lines.append((r.base_s + r.per_seq_s * d.large_batch_from, r.per_ctx_token_s))
            work_lines.append(
                (e.tp * (r.base_s / e.max_num_seqs + r.per_seq_s), e.tp * r.per_ctx_token_s)
            )
    return Lines.envelope(time_lines), Lines.envelope(work_lines)


def _lowest(arrays: Sequence[F64]) -> F64:
    """Element-wise minimum of equal-shaped arrays."""
    return reduce(np.minimum, arrays)


def _context_grid() -> F64:
    """Contexts the blended decode cost is tabulated at: every 64 tokens to 1024, then
    steps of 2**(1/16) to 2**22 (beyond, the last value: the cost grows with context)."""
    fine = np.arange(0.0, 1024.0, 64.0)
    coarse = 2.0 ** np.arange(10.0, 22.0 + 1e-9, 1.0 / 16.0)
    return np.concatenate((fine, coarse))


def _shared_steps(e: EngineProfile) -> list[tuple[float, float, float, int, int]]:
    """The decode steps a token can share with ``m`` sequences of accepted trajectories,
    as (fixed s, s per sequence, s per context token, least m, most m). Small regime: the
    step holds ``n`` in ``[m, large_batch_from)``. Large regime: ``n >= large_batch_from``
    and ``n >= m``, so for ``m`` below the threshold its per-sequence cost at the threshold
    is a fixed cost."""
    d = e.decode
    lbf, top = d.large_batch_from, e.max_num_seqs
    small, large = d.small, d.large
    out = []
    if min(lbf - 1, top) >= 1:
        out.append((small.base_s, small.per_seq_s, small.per_ctx_token_s, 1, min(lbf - 1, top)))
    if top >= lbf:
        if lbf > 1:
            fixed = large.base_s + large.per_seq_s * lbf
            out.append((fixed, 0.0, large.per_ctx_token_s, 1, lbf - 1))
        out.append((large.base_s, large.per_seq_s, large.per_ctx_token_s, lbf, top))
    return out


def _blended_decode(engines: Sequence[EngineProfile], mu: float, ctx: F64) -> F64:
    """Per output token at each context ``C``, the least GPU-seconds + ``mu`` x seconds in
    flight it adds in a decode step with ``m`` accepted sequences (``_shared_steps``):
    GPU share ``tp (fixed / m + per_seq + per_ctx C)``, time ``fixed + m (per_seq +
    per_ctx C)`` (the step lasts at least ``fixed + per_seq m + per_ctx K`` for each of
    the ``m``, ``K`` their contexts), at the best real ``m`` in range. A minimum of lines
    in ``C``: concave and non-decreasing."""
    best = np.full(ctx.shape, np.inf)
    for e in engines:
        for fixed_s, per_seq_s, per_ctx_s, lo, hi in _shared_steps(e):
            per_seq = per_seq_s + per_ctx_s * ctx  # per sequence of context C
            fixed_gpu_s = e.tp * fixed_s
            # the best real m: sqrt(fixed / (mu per_seq)), the largest where per_seq is 0
            safe = np.where(per_seq > 0.0, per_seq, 1.0)
            m = np.where(per_seq > 0.0, np.sqrt(fixed_gpu_s / (mu * safe)), float(hi))
            m = np.clip(m, float(lo), float(hi))
            cost = e.tp * per_seq + mu * fixed_s + fixed_gpu_s / m + mu * m * per_seq
            best = np.minimum(best, cost)
    return best


@dataclass(frozen=True)
class TrajectoryCosts:
    """Per trajectory of ``specs``, in order: own time and work lower bounds, and per
    ``CostModel.mus`` entry ``k`` (column) the blended cost GPU-seconds + mu_k x seconds
    in flight (``blended_gpu_s``)."""

    own_s: F64
    work_gpu_s: F64
    blended_gpu_s: F64  # shape (trajectories, len(mus))


class CostModel:
    """The lower bounds of the module docstring on the cheapest of ``engines``; ``mus``:
    the prices of a second in flight, in GPUs, of the blended costs."""

    def __init__(self, engines: Sequence[EngineProfile], mus: Sequence[float] = ()) -> None:
        if not engines:
            raise ValueError("no engines")
        if any(mu <= 0.0 for mu in mus):
            raise ValueError("mus must be > 0")
        self.engines = tuple(engines)
        self.mus = tuple(mus)
        self.decode_s, self.decode_gpu_s = _decode_lines(self.engines)
        self._grid = _context_grid()
        self._blended = [_blended_decode(self.engines, mu, self._grid) for mu in self.mus]

    def costs(self, specs: Sequence[TrajectorySpec]) -> TrajectoryCosts:
        n = len(specs)
        if n == 0:
            empty = np.zeros(0)
            return TrajectoryCosts(empty, empty, np.zeros((0, len(self.mus))))
        turns = np.fromiter((s.num_turns for s in specs), np.int64, n)
        new = np.fromiter(chain.from_iterable(s.new_tokens for s in specs), np.float64)
        out = np.fromiter(chain.from_iterable(s.output_tokens for s in specs), np.float64)
        prompt = np.fromiter((s.prompt_tokens for s in specs), np.float64, n)
        tool_s = np.fromiter((sum(s.tool_latency_s) for s in specs), np.float64, n)
        first = np.concatenate(([0], np.cumsum(turns)[:-1]))
        new[first] = prompt  # turn 0's new tokens are the prompt (new_tokens[0] == 0)
        # ctx: the whole prompt of each turn, prompt + sum(new[:i+1]) + sum(out[:i])
        seen = np.cumsum(new) + np.cumsum(out) - out
        before = np.repeat(seen[first] - new[first], turns)
        ctx = seen - before
        quad = new * (2.0 * ctx - new)
        # per distinct prefill model: (GPU-seconds, seconds) of each turn's prefill
        prefills = {
            (e.tp, e.prefill.a_s, e.prefill.b_s_per_token, e.prefill.c_s_per_token2)
            for e in self.engines
        }
        pre = [(tp * (b * new + c * quad), a + b * new + c * quad) for tp, a, b, c in prefills]
        traj = np.repeat(np.arange(n), turns)

        def per_trajectory(per_turn: F64) -> F64:
            return np.bincount(traj, weights=per_turn, minlength=n).astype(np.float64)

        pre_s = _lowest([t for _, t in pre])
        pre_gpu_s = _lowest([w for w, _ in pre])
        own_s = per_trajectory(pre_s + self.decode_s.token_sums(ctx, out)) + tool_s
        work = per_trajectory(pre_gpu_s + self.decode_gpu_s.token_sums(ctx, out))
        blended = np.zeros((n, len(self.mus)))
        last = ctx + out - 1.0
        for k, (mu, table) in enumerate(zip(self.mus, self._blended, strict=True)):
            # concave in C: the sum over a turn's contexts is at least its chord's; the
            # table's interpolation is below the function (concave) and so is its chord
            dec = out * (np.interp(ctx, self._grid, table) + np.interp(last, self._grid, table))
            turn = _lowest([w + mu * t for w, t in pre]) + dec / 2.0
            blended[:, k] = per_trajectory(turn) + mu * tool_s
        return TrajectoryCosts(own_s, work, blended)


# The least any trajectory can be: one turn of one prompt token and one output token, no
# tool (a restarted trajectory's fresh sample is unknown to the oracle; it is at least this).
SMALLEST_TRAJECTORY = TrajectorySpec(1, (0,), (1,), ())
