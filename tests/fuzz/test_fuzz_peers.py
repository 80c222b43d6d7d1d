"""The fuzz suite over what peers send and what runs leave: control messages, knock
lines (to a real ``KnockListener`` on a real socket) and run logs (``pearl analyze``).

Properties: a message decodes or raises one ``ProtocolError`` line; a knock line of any
bytes is refused (counted) and the listener admits the right knock at once afterwards; a
run log with mutated or mangled lines is analysed with the bad lines skipped and counted
(the reader is documented as tolerant), or exits 2 with one line.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml
from fuzzing import FUZZ
from hypothesis import given
from hypothesis import strategies as st
from mutation import mangled, mutated
from surfaces import assert_one_line_error, bounded, run_pearl
from test_fuzz_documents import SCENARIO

from pearl.control.messages import (
    Ack,
    Bye,
    Command,
    ControlAction,
    Heartbeat,
    Hello,
    ProtocolError,
    Welcome,
    decode,
    encode,
)
from pearl.control.rendezvous import KnockListener, KnockRefused, knock
from pearl.runlog.jsonl import ReadStats, read_records

MESSAGES = [
    Hello(token="t", agent_id="a", node="n", gpus=(), job_id="7", pid=3, workers=("w",)),
    Welcome(agent_id="a", heartbeat_s=1.0, missed_heartbeats=3),
    Heartbeat(seq=4, t=12.5),
    Command(cmd_id="c", step_id=1, action=ControlAction.ABORT_DRAIN, worker_id="w", deadline_s=5),
    Ack(cmd_id="c", ok=True, elapsed_s=0.5, url="http://127.0.0.1:1"),
    Bye(reason="done"),
]


@FUZZ
@given(doc=st.sampled_from([json.loads(encode(m)) for m in MESSAGES]).flatmap(mutated))
def test_a_mutated_control_message_decodes_or_names_its_problem(doc: Any) -> None:
    raw = json.dumps(doc).encode()
    with bounded("decode"):
        try:
            decode(raw)
        except ProtocolError as err:
            assert "\n" not in str(err)


@FUZZ
@given(raw=st.sampled_from([encode(m) for m in MESSAGES]).flatmap(mangled))
def test_a_mangled_control_message_decodes_or_names_its_problem(raw: bytes) -> None:
    with bounded("decode"):
        try:
            decode(raw)
        except ProtocolError as err:
            assert "\n" not in str(err)


TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def listener() -> Iterator[KnockListener]:
    lst = KnockListener("127.0.0.1", TOKEN, bind_host="127.0.0.1")
    yield lst
    lst.close()


def _admit_one(lst: KnockListener) -> float:
    """Seconds until a right knock is admitted: knocked from a thread, admitted here as
    the coordinator's accept loop does."""
    t0 = time.monotonic()
    with ThreadPoolExecutor(1) as pool:
        knocked = pool.submit(knock, lst.host, lst.port, TOKEN, "probe-1")
        got = lst.poll()
        while got is None and time.monotonic() - t0 < 5:
            got = lst.poll()
        assert got is not None and got.agent_id == "probe-1"
        lst.admit(got)
        knocked.result(timeout=5).close()
    got.conn.close()
    return time.monotonic() - t0


GOOD_KNOCK = f"pearl-knock {TOKEN} 2 agent-1\n".encode()
knock_lines = st.one_of(
    st.binary(max_size=6000),
    mangled(GOOD_KNOCK),
    st.sampled_from(
        [
            b"[" * 3000 + b"\n",
            b"pearl-knock wrong 2 a\n",
            f"pearl-knock {TOKEN} 1 a\n".encode(),
            f"pearl-knock {TOKEN} 2 a b\n".encode(),
            f"pearl-knock {TOKEN} 2 \xff\n".encode(),
            f"pearl-knock {TOKEN} 2 {'a' * 200}\n".encode(),
            b'{"v": 1, "token": "s3cret-token", "agent_id": "a"}\n',  # version 1's line
            b"\n",
        ]
    ),
)


@FUZZ
@given(line=knock_lines)
def test_any_knock_line_is_refused_and_the_next_right_one_admitted(
    line: bytes, listener: KnockListener
) -> None:
    if line.endswith(GOOD_KNOCK):
        return  # a right knock, mangled into itself
    refused = listener.refused
    with socket.create_connection((listener.host, listener.port), timeout=5) as s:
        with contextlib.suppress(ConnectionResetError):  # past MAX_LINE: refused unread
            s.sendall(line if line.endswith(b"\n") else line + b"\n")
        got = listener.poll()
        if got is not None:  # a mangle that kept it a right knock ("\n" spliced first)
            assert GOOD_KNOCK.split()[-1].startswith(got.agent_id.encode()), line
            got.conn.close()
            return
        try:
            reply = s.recv(4096)
        except ConnectionResetError:
            reply = b"(reset)"
    assert reply.startswith(b'{"ok": false') or reply == b"(reset)", reply
    assert listener.refused == refused + 1
    assert _admit_one(listener) < 1.0


def test_a_wrong_token_is_refused_before_the_rest_is_read(listener: KnockListener) -> None:
    with pytest.raises(KnockRefused, match="wrong token"):
        knock(listener.host, listener.port, "not-the-token", "a")
    assert _admit_one(listener) < 1.0


@pytest.fixture(scope="module")
def run_log(tmp_path_factory: pytest.TempPathFactory) -> list[bytes]:
    """The lines of a real run log: the simulator on a tiny scenario, 300 s."""
    folder = tmp_path_factory.mktemp("sim")
    scenario = folder / "tiny.yaml"
    scenario.write_text(yaml.safe_dump(SCENARIO))
    argv = ["simulate", str(scenario), "--policies", "pearl", "--seeds", "1", "--json"]
    outcome = run_pearl([*argv, "--duration-s", "300", "--out", str(folder / "out")])
    assert outcome.code == 0, outcome.err
    (log,) = (folder / "out").rglob("*.jsonl")
    return log.read_bytes().splitlines(keepends=True)


@FUZZ
@given(data=st.data())
def test_analyze_of_a_mutated_run_log(
    data: st.DataObject, run_log: list[bytes], tmp_path: Path
) -> None:
    lines = list(run_log)
    for _ in range(data.draw(st.integers(min_value=1, max_value=4))):
        i = data.draw(st.integers(min_value=0, max_value=len(lines) - 1))
        if data.draw(st.booleans()):
            lines[i] = json.dumps(data.draw(mutated(json.loads(lines[i])))).encode() + b"\n"
        else:
            lines[i] = data.draw(mangled(lines[i]))
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    log = run_dir / "run.jsonl"
    log.write_bytes(b"".join(lines))
    stats = ReadStats()
    with bounded("read_records"):
        records = list(read_records(log, stats))
    assert stats.records == len(records) and stats.lines >= len(records)
    outcome = run_pearl(["analyze", str(run_dir), "--out", str(tmp_path / "out"), "--json"])
    assert_one_line_error(outcome, run_dir)
