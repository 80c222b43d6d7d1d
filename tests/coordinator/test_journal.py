"""The coordinator's journal: durable, replayable, continued after a restart, strict on
corruption, tolerant of a write cut short by a crash (in a real separate process)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pearl.bench.synth import Layout, build_state
from pearl.coordinator.journal import Journal, replay
from pearl.core.state import ClusterState
from pearl.io.documents import InputError


def _state() -> ClusterState:
    return build_state(Layout(1, 2, 1))


def test_replay_returns_the_last_state_and_the_unfinished_intents(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    first, second = _state(), _state().evolve(time_s=5.0, policy_version=3)
    with Journal(path) as j:
        j.state(first, t=0.0)
        j.intent("a1", "submit", t=1.0, allocation_id="el0001", num_gpus=8)
        j.intent("p1", "plan", t=2.0, num_steps=4)
        j.done("a1", t=3.0)
        j.state(second, t=5.0)
    r = replay(path)
    assert r.state == second
    assert list(r.open_intents) == ["p1"] and r.open_intents["p1"]["num_steps"] == 4
    assert (r.next_seq, r.num_records, r.truncated_tail) == (5, 5, False)


def test_a_restarted_journal_continues_its_sequence(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    with Journal(path) as j:
        j.state(_state(), t=0.0)
    r = replay(path)
    with Journal(path, r.next_seq) as j:
        assert j.intent("x", "release", t=1.0) == 1
    assert replay(path).next_seq == 2
    with pytest.raises(InputError, match="seq: 0, expected 2"):
        with Journal(path, 0) as j:  # a writer that did not replay first
            j.state(_state(), t=2.0)
        replay(path)


def test_corruption_in_the_middle_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    with Journal(path) as j:
        j.state(_state(), t=0.0)
        j.intent("a", "submit", t=1.0)
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], "{not json", lines[1]]) + "\n")
    with pytest.raises(InputError, match=r"journal.jsonl: line 2: corrupt journal record"):
        replay(path)


def test_a_record_cut_short_at_the_end_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    with Journal(path) as j:
        j.state(_state(), t=0.0)
    with path.open("a") as f:
        f.write('{"v":1,"seq":1,"t":1.0,"kind":"int')  # the crash hit mid-write
    r = replay(path)
    assert r.truncated_tail and r.num_records == 1 and r.state is not None


_WRITER = """
import sys, time
from pathlib import Path
from pearl.coordinator.journal import Journal
j = Journal(Path(sys.argv[1]))
i = 0
while True:
    j.intent(f"i{i}", "plan", t=float(i), payload="x" * 2000)
    j.done(f"i{i}", t=float(i))
    i += 1
    if i == 50:
        print("ready", flush=True)
"""


def test_a_writer_killed_with_sigkill_loses_nothing_it_acknowledged(tmp_path: Path) -> None:
    """Every record written before the kill replays; at most the last is cut short."""
    path = tmp_path / "journal.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(path)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    r = replay(path)
    assert r.num_records >= 100
    # intents and their done records come in pairs: at most the last intent is open
    assert len(r.open_intents) <= 1


def test_a_record_cut_short_is_cut_off_before_the_next_writes(tmp_path: Path) -> None:
    """Reopened after a crash mid-write, the journal stays readable: the partial record
    does not end up in the middle."""
    path = tmp_path / "journal.jsonl"
    with Journal(path) as j:
        j.state(_state(), t=0.0)
    with path.open("a") as f:
        f.write('{"v":1,"seq":1,"t":1.0,"kind":"intent","data":{"id":"x"}}')  # no newline
    r = replay(path)
    assert r.truncated_tail and r.next_seq == 1
    with Journal(path, r.next_seq, r.valid_bytes) as j:
        j.intent("y", "plan", t=2.0)
    again = replay(path)
    assert (again.num_records, again.truncated_tail, list(again.open_intents)) == (2, False, ["y"])


def test_a_second_writer_is_refused_while_the_first_holds_the_journal(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    with Journal(path) as first:
        first.state(_state(), t=0.0)
        with pytest.raises(InputError, match="another coordinator is writing this journal"):
            Journal(path, 1)
    with Journal(path, replay(path).next_seq) as again:  # released on close
        again.intent("x", "plan", t=1.0)


def test_a_compacted_journal_replays_to_the_same_state_and_submissions(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    state = _state()
    held = next(a.allocation_id for a in state.allocations if a.kind.value == "elastic")
    with Journal(path) as j:
        for i in range(50):
            j.state(state.evolve(time_s=float(i)), t=float(i))
        j.intent(held, "submit", t=50.0, num_gpus=8)  # the state holds it: not kept
        j.intent("el0042", "submit", t=51.0, num_gpus=8)  # announced, not in the state yet
        j.done("el0042", t=52.0)
        j.state(state, t=53.0)
        before = replay(path)
        size = j.size_bytes()
        assert j.submitted == before.submitted  # what it wrote is what a replay finds
        j.compact(state, 54.0)
        assert j.size_bytes() < size / 10
        assert j.intent("p1", "plan", t=55.0) == before.next_seq + 2  # the count goes on
    after = replay(path)
    assert after.state == state
    assert list(after.submitted) == ["el0042"]
    assert after.next_seq == before.next_seq + 3 and after.num_records == 3
    assert not path.with_name(path.name + ".compact").exists()


def test_a_corrupt_run_json_is_one_line_naming_the_field(tmp_path: Path) -> None:
    """``RUN_DIR/run.json`` (the run's first start, its Slurm jobs) is read like every
    document: a corrupt one stops the coordinator in one line, never a traceback."""
    from pearl.coordinator.job import run_start_s

    first = run_start_s(tmp_path)
    assert run_start_s(tmp_path) == first  # written once, read back
    for text, needle in [
        ("[", "run.json: line 1: malformed JSON"),
        ('{"started_at_unix_s": "x"}', "run.json: started_at_unix_s: must be a time"),
        ('{"slurm_job_ids": 3}', "run.json: slurm_job_ids: must be a list"),
    ]:
        (tmp_path / "run.json").write_text(text)
        with pytest.raises(InputError, match=needle):
            run_start_s(tmp_path)
