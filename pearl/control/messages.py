"""Control-plane messages: versioned, validated, JSON on the wire (never pickle).

Every message carries ``v`` (the schema version, :data:`PROTOCOL_VERSION`) and ``type``.
:func:`encode` turns a message into UTF-8 JSON bytes; :func:`decode` turns bytes from a
peer back into a message and raises :class:`ProtocolError` (a ``ValueError``) naming the
offending field on anything else: bad JSON, a foreign version, an unknown type, a missing,
extra or mistyped field. Nothing received is ever unpickled or evaluated.

When ``v`` changes: a field removed, retyped or given another meaning is a new version. A
field added with a default (``Hello.workers``, ``Ack.url``) keeps the version: a receiver
reads a sender's message without it as before, and both ends of a run come from one pearl
install (allocations start their agents from it), so a receiver that does not know the
field is an install mixed mid-run, which the strict schema refuses naming the field.

A message type added (``WorkersExited``) keeps the version for the same reason.

Direction: ``Hello``, ``Ack``, ``Preempted``, ``WorkersExited`` go agent -> coordinator;
``Welcome``, ``Command`` coordinator -> agent; ``Heartbeat`` and ``Bye`` both ways.

A command's ``action`` is a :class:`~pearl.core.plan.Action` (the core's own members, so
the agent speaks the plan's vocabulary) or a :class:`ControlAction`, the few actions only
the control plane sends: ``abort_drain``, the compensation of a drain whose role change
was aborted (phase draining -> ready), is not a step any plan contains. A separate enum,
rather than one enum repeating ``Action``'s members plus these, keeps a single list of
plan actions (a new one needs no second edit here) and keeps the control plane's own
actions out of the core, which does not know them. Its ``role`` is a
:class:`~pearl.core.roles.Role`. On the wire both are their string values, as before; an
unknown value is a :class:`ProtocolError` like any other bad field.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WrapValidator,
)
from pydantic_core import PydanticCustomError

from pearl.core.limits import MAX_GPUS_PER_NODE, MAX_SECONDS
from pearl.core.plan import Action
from pearl.core.roles import Role
from pearl.io.untrusted import UntrustedInput, loads_json

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 1 << 20  # a peer that sends more is broken or hostile


class ControlAction(StrEnum):
    """Actions of the control plane that are no plan step."""

    ABORT_DRAIN = "abort_drain"  # undo a drain whose role change was aborted: draining -> ready


COMMAND_ACTIONS: tuple[Action | ControlAction, ...] = (*Action, *ControlAction)


def _command_action(
    value: Any, handler: ValidatorFunctionWrapHandler, info: ValidationInfo
) -> Action | ControlAction:
    """One line for an unknown action, not one per enum of the union."""
    try:
        action: Action | ControlAction = handler(value)
    except ValidationError:
        if info.mode != "json":
            raise
        names = ", ".join(a.value for a in COMMAND_ACTIONS)
        raise PydanticCustomError(
            "command_action",
            "unknown action {action} (one of {names})",
            {"action": repr(value), "names": names},
        ) from None
    return action


CommandAction = Annotated[Action | ControlAction, WrapValidator(_command_action)]


class ProtocolError(ValueError):
    """A received message that is not a valid message of this protocol version."""


class _Msg(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)
    v: Literal[1] = 1  # PROTOCOL_VERSION


class GpuInfo(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)
    id: str = Field(min_length=1)
    type: str = Field(min_length=1)


class Hello(_Msg):
    type: Literal["hello"] = "hello"
    token: str = Field(min_length=1)
    agent_id: str = Field(min_length=1)
    node: str = Field(min_length=1)
    gpus: tuple[GpuInfo, ...] = Field((), max_length=MAX_GPUS_PER_NODE)
    job_id: str | None = None  # the Slurm allocation the agent runs in, if any
    pid: int = 0
    workers: tuple[str, ...] = ()  # ids of the workers it runs (none after a restart)


class Welcome(_Msg):
    type: Literal["welcome"] = "welcome"
    agent_id: str
    heartbeat_s: float = Field(gt=0, le=3600)
    missed_heartbeats: int = Field(ge=1, le=1000)


class Heartbeat(_Msg):
    type: Literal["heartbeat"] = "heartbeat"
    seq: int = Field(ge=0)
    t: float  # sender's wall clock, for diagnostics only (never compared across hosts)


class Command(_Msg):
    type: Literal["command"] = "command"
    cmd_id: str = Field(min_length=1)
    step_id: int
    action: CommandAction
    worker_id: str = Field(min_length=1)
    gpu_ids: tuple[str, ...] = ()
    role: Role | None = None
    deadline_s: float = Field(gt=0, le=MAX_SECONDS)  # time budget from receipt


class Ack(_Msg):
    type: Literal["ack"] = "ack"
    cmd_id: str = Field(min_length=1)
    ok: bool
    error: str | None = None
    elapsed_s: float = Field(ge=0, le=MAX_SECONDS)
    url: str | None = None  # a start's or wake's engine: its base URL, as its agent reaches it


class Preempted(_Msg):
    type: Literal["preempted"] = "preempted"
    grace_s: float = Field(ge=0, le=MAX_SECONDS)
    signal: str = ""


class WorkersExited(_Msg):
    """Workers of the agent's node whose processes ended by themselves, with their exit
    statuses (a negative one: the signal that killed it)."""

    type: Literal["workers_exited"] = "workers_exited"
    exit_codes: dict[str, int] = Field(min_length=1)  # worker id -> its exit status


class Bye(_Msg):
    type: Literal["bye"] = "bye"
    reason: str = ""
    # from a coordinator that stops to come back (requeued, signalled): the agent keeps
    # its allocation and joins the next incarnation (exit EXIT_LOST), instead of ending it
    restarting: bool = False


Message = Annotated[
    Hello | Welcome | Heartbeat | Command | Ack | Preempted | WorkersExited | Bye,
    Field(discriminator="type"),
]
_ADAPTER: TypeAdapter[Any] = TypeAdapter(Message)
MESSAGE_TYPES = (
    "hello",
    "welcome",
    "heartbeat",
    "command",
    "ack",
    "preempted",
    "workers_exited",
    "bye",
)


def encode(msg: BaseModel) -> bytes:
    if not isinstance(msg, _Msg):
        raise TypeError(f"not a control message: {type(msg).__name__}")
    return msg.model_dump_json().encode()


def decode(data: bytes | bytearray | memoryview) -> Any:
    """Parse and validate one message; raise :class:`ProtocolError` naming the field."""
    raw = bytes(data)
    try:
        obj = loads_json(raw, max_bytes=MAX_MESSAGE_BYTES)
    except UntrustedInput as e:
        raise ProtocolError(f"message: {e}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"message must be a JSON object, got {type(obj).__name__}")
    if "v" not in obj:
        raise ProtocolError("field 'v': missing (protocol version)")
    if obj["v"] != PROTOCOL_VERSION or isinstance(obj["v"], bool):
        raise ProtocolError(
            f"field 'v': unsupported protocol version {obj['v']!r}, expected {PROTOCOL_VERSION}"
        )
    if obj.get("type") not in MESSAGE_TYPES:
        raise ProtocolError(f"field 'type': unknown message type {obj.get('type')!r}")
    try:
        return _ADAPTER.validate_json(raw)  # strict JSON mode: arrays are tuples
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(p) for p in first["loc"][1:]) or "<message>"
        raise ProtocolError(f"{obj['type']} field '{loc}': {first['msg']}") from None
