"""Wire format: round trips and clear errors on malformed input (pure, no MPI)."""

from __future__ import annotations

import json
import os
import stat

import pytest

from pearl.control.messages import (
    COMMAND_ACTIONS,
    Ack,
    Bye,
    Command,
    ControlAction,
    GpuInfo,
    Heartbeat,
    Hello,
    Preempted,
    ProtocolError,
    Welcome,
    decode,
    encode,
)
from pearl.control.portfile import PortInfo, read_port_file, write_port_file
from pearl.core.plan import Action
from pearl.core.roles import Role
from pearl.io.documents import InputError

ALL = [
    Hello(token="t", agent_id="a", node="n", gpus=(GpuInfo(id="n/0", type="h100"),)),
    Welcome(agent_id="a", heartbeat_s=0.5, missed_heartbeats=6),
    Heartbeat(seq=3, t=1.5),
    Command(
        cmd_id="c1",
        step_id=4,
        action=Action.SWITCH,
        worker_id="w",
        gpu_ids=("n/0",),
        role=Role.DECODE,
        deadline_s=5.0,
    ),
    Command(
        cmd_id="c2", step_id=4, action=ControlAction.ABORT_DRAIN, worker_id="w", deadline_s=5.0
    ),
    Ack(cmd_id="c1", ok=False, error="boom", elapsed_s=0.1),
    Ack(cmd_id="c3", ok=True, elapsed_s=2.5, url="http://127.0.0.1:8000"),  # a start's
    Preempted(grace_s=30.0, signal="SIGUSR2"),
    Bye(reason="done"),
]


@pytest.mark.parametrize("msg", ALL, ids=lambda m: m.type)
def test_round_trip(msg: object) -> None:
    assert decode(encode(msg)) == msg  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b"{not json", "malformed JSON"),
        (b"[1]", "JSON object"),
        (b'{"type": "bye"}', "field 'v'"),
        (b'{"v": 2, "type": "bye"}', "unsupported protocol version 2"),
        (b'{"v": true, "type": "bye"}', "unsupported protocol version"),
        (b'{"v": 1, "type": "pickle"}', "unknown message type 'pickle'"),
        (b'{"v": 1, "type": "ack", "cmd_id": "c", "ok": "yes", "elapsed_s": 0}', "'ok'"),
        (b'{"v": 1, "type": "command", "step_id": 1}', "'cmd_id'"),
        (b'{"v": 1, "type": "bye", "reason": "x", "extra": 1}', "'extra'"),
        (
            b'{"v": 1, "type": "hello", "token": "t", "agent_id": "a", "node": "n",'
            b' "gpus": [{"id": 0, "type": "h100"}]}',
            "'gpus.0.id'",
        ),
        (b"\xff\xfe", "malformed JSON"),
        (
            b'{"v": 1, "type": "command", "cmd_id": "c", "step_id": 0, "action": "explode",'
            b' "worker_id": "w", "deadline_s": 1}',
            "command field 'action': unknown action 'explode' (one of start, wake,",
        ),
        (
            b'{"v": 1, "type": "command", "cmd_id": "c", "step_id": 0, "action": "DRAIN",'
            b' "worker_id": "w", "deadline_s": 1}',
            "unknown action 'DRAIN'",
        ),
        (
            b'{"v": 1, "type": "command", "cmd_id": "c", "step_id": 0, "action": 3,'
            b' "worker_id": "w", "deadline_s": 1}',
            "unknown action 3",
        ),
        (
            b'{"v": 1, "type": "command", "cmd_id": "c", "step_id": 0, "action": "switch",'
            b' "worker_id": "w", "role": "boss", "deadline_s": 1}',
            "command field 'role': Input should be 'train', 'colocated'",
        ),
        (b"[" * 3000 + b"]" * 3000, "nested more than 32 deep"),
        (b'{"v": 1, "type": "heartbeat", "seq": 0, "t": NaN}', "t: nan is not a finite number"),
        (b'{"v": 1, "type": "heartbeat", "seq": 0, "t": 1e999}', "t: inf is not a finite"),
        (b'{"v": 1, "type": "bye", "reason": "\\ud800"}', "reason: text with a lone surrogate"),
    ],
)
def test_malformed_messages_name_the_problem(raw: bytes, needle: str) -> None:
    with pytest.raises(ProtocolError, match=None) as e:
        decode(raw)
    assert needle in str(e.value)
    assert "\n" not in str(e.value)  # one line
    assert isinstance(e.value, ValueError)


def test_an_ack_without_a_url_reads_as_none() -> None:
    """``Ack.url`` was added with a default (the version stays, messages.py's rule)."""
    ack = decode(b'{"v": 1, "type": "ack", "cmd_id": "c", "ok": true, "elapsed_s": 0}')
    assert isinstance(ack, Ack) and ack.url is None


@pytest.mark.parametrize("action", COMMAND_ACTIONS, ids=str)
def test_actions_are_their_plain_strings_on_the_wire(action: Action | ControlAction) -> None:
    """The plan's actions and the control plane's own, as the same strings as before."""
    cmd = Command(cmd_id="c", step_id=0, action=action, worker_id="w", deadline_s=1.0)
    assert json.loads(encode(cmd))["action"] == action.value
    raw = encode(cmd).replace(b'"role":null', b'"role":"prefill"')
    back = decode(raw)
    assert back.action is action and back.role is Role.PREFILL


def test_control_actions_are_no_plan_actions() -> None:
    assert not {a.value for a in ControlAction} & {a.value for a in Action}
    assert len(COMMAND_ACTIONS) == len(Action) + len(ControlAction)


def test_port_file_is_private_and_checked(tmp_path: object) -> None:
    from pathlib import Path

    run = Path(str(tmp_path))
    info = PortInfo("port-name", "127.0.0.1", 1234, "secret", 7)
    path = write_port_file(run, info)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_port_file(run) == info
    os.chmod(path, 0o644)
    with pytest.raises(InputError, match="0600"):
        read_port_file(run)
    os.chmod(path, 0o600)
    path.write_text(json.dumps({"v": 1, "port": "p"}))
    with pytest.raises(InputError, match="knock_host"):
        read_port_file(run)
    path.write_text(json.dumps({**info.__dict__, "v": 1, "knock_port": 10**30}))
    with pytest.raises(InputError, match="knock_port: missing, or not an integer from 0"):
        read_port_file(run)
    path.write_text("[" * 5000)
    with pytest.raises(InputError, match=r"port\.json"):
        read_port_file(run)
