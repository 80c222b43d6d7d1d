"""The engine models a scenario may pick (``Scenario.engine_model``), behind one interface.

``step`` (``pearl.sim.engine.EngineModel``, the default and the reference) runs vLLM's
scheduler step by step; ``fluid`` (``pearl.sim.fluid_engine.FluidEngineModel``) runs to
the next change of its batch in one call, at a fraction of the simulator's time
(``docs/simulator.md``, "Engine models"). ``InstanceEngine`` is what the fleet and the
run loop use of either.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal, Protocol

from pearl.core.profile import EngineProfile, RuntimeProfile
from pearl.core.roles import Role
from pearl.serving.requests import PartialOutput, Request
from pearl.sim.engine import EngineModel, EngineStepResult
from pearl.sim.fluid_engine import FluidEngineModel

EngineModelName = Literal["step", "fluid"]


class InstanceEngine(Protocol):
    """One inference instance's engine, as the fleet and the run loop drive it."""

    role: Role
    engine: EngineProfile
    num_requests: int  # running and waiting
    on_requests_changed: Callable[[], None] | None  # called after num_requests changes

    @property
    def has_work(self) -> bool: ...

    @property
    def num_decoding(self) -> int: ...

    @property
    def decoding_context_tokens(self) -> int: ...

    def queued_prefill(self) -> tuple[int, int]: ...

    def num_generated(self, request_id: str) -> int: ...

    def cached_tokens(self, traj_id: str) -> int: ...

    def request_ids(self) -> set[str]: ...

    def generated_by_request(self) -> list[tuple[Request, int]]: ...

    def submit(self, request: Request) -> None: ...

    def abort(self, request_id: str) -> PartialOutput | None: ...

    def drain(self) -> tuple[PartialOutput, ...]: ...

    def abort_all(self) -> tuple[PartialOutput, ...]: ...

    def resume(self) -> None: ...

    def step(self, max_steps: int = 1, max_duration_s: float = math.inf) -> EngineStepResult: ...


def make_engine(
    model: EngineModelName, role: Role, profile: RuntimeProfile, gpu_type: str, tp: int
) -> InstanceEngine:
    """An engine of the named model for one instance."""
    if model == "fluid":
        return FluidEngineModel.from_profile(role, profile, gpu_type, tp)
    return EngineModel.from_profile(role, profile, gpu_type, tp)
