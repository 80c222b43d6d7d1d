"""Hostile code stays inside the Python sandbox's limits: fork bombs, process storms,
daemons that leave the process group, memory hogs, endless loops in descendants, writes
outside the working directory, network attempts and output floods, all on real processes.

After every hostile run the call has returned within its bound, no process of the run is
left (none runs as its uid, none has its directory in its command line or environment),
its directory is gone and the next ordinary run still works. Which guarantees hold depends
on what the host grants (root for a uid of its own, ``CAP_SYS_ADMIN`` for the namespaces);
a test of a guarantee the host cannot give is skipped with the reason.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pearl.envs.sandbox import (
    CHILD,
    DRAIN_AFTER_KILL_S,
    SWEEP_S,
    Sandbox,
    SandboxConfig,
    SandboxError,
    SandboxResult,
    render,
)

HOSTILE = SandboxConfig(timeout_s=1.5, cpu_time_s=5, memory_mb=256, max_processes=8)
# The call returns within timeout_s plus the sweep and the drain; the rest is slack for a
# loaded machine (starting the interpreter, the event loop's turns).
SLACK_S = 3.0
PRELUDE = "import os, sys, time\nprint(os.getcwd(), flush=True)\n"  # names the run's folder


def _run(code: str, config: SandboxConfig = HOSTILE) -> tuple[SandboxResult, str, float]:
    start = time.monotonic()
    result = asyncio.run(Sandbox(config).run(PRELUDE + code))
    return result, render(result, config), time.monotonic() - start


def _proc_text(pid: str, name: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes()
    except OSError:
        return b""


def _left_over(run_dir: str, uid: int | None) -> list[str]:
    """Live processes of the run: its uid, or its folder in their command line (forks of
    the launcher) or environment (what they started): ``PID: CMDLINE`` each."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        status = _proc_text(pid, "status").decode(errors="replace")
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        if not fields or fields.get("State", "").startswith(("Z", "X")):
            continue
        uids = [int(x) for x in fields.get("Uid", "").split()[:2]]
        marked = run_dir.encode() in _proc_text(pid, "cmdline") + _proc_text(pid, "environ")
        if marked or (uid is not None and uid in uids):
            command = _proc_text(pid, "cmdline").replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{pid}: {command}")
    return found


def _assert_contained(result: SandboxResult, elapsed_s: float, config: SandboxConfig) -> None:
    """The run returned in time, left no process and no folder, and the sandbox works."""
    assert elapsed_s < config.timeout_s + SWEEP_S + DRAIN_AFTER_KILL_S + SLACK_S, elapsed_s
    work = result.stdout.split("\n", 1)[0]
    assert work.endswith("/work"), result
    run_dir = str(Path(work).parent)
    assert _left_over(run_dir, result.uid) == []
    assert result.contained
    assert not Path(run_dir).exists()
    after = asyncio.run(Sandbox(config).run("print(6 * 7)"))
    assert (after.exit_code, after.stdout) == (0, "42\n")


def _needs(result: SandboxResult, *, own_uid: bool = False, namespace: bool = False) -> None:
    if own_uid and result.uid is None:
        pytest.skip("no uid of its own here (pearl is not root, or lacks the capabilities)")
    if namespace and result.isolation != "namespace":
        pytest.skip("no PID and mount namespaces here (no CAP_SYS_ADMIN, or refused)")


def _count(text: str, word: str) -> int:
    """The number after ``word`` on its line of ``text``."""
    lines = [line for line in text.splitlines() if line.startswith(word)]
    assert lines, f"no {word!r} line in {text!r}"
    return int(lines[0].split()[1])


def test_fork_bomb_is_capped_at_max_processes() -> None:
    code = (
        "n = 0\n"
        "try:\n"
        "    for _ in range(200):\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(60)\n"
        "            os._exit(0)\n"
        "        n += 1\n"
        "except OSError as err:\n"
        "    print('refused', n, type(err).__name__, flush=True)\n"
        "time.sleep(60)\n"
    )
    result, text, elapsed = _run(code)
    assert result.timed_out, text
    refused = _count(result.stdout, "refused")
    if result.uid is None and result.network == "audit_hook":
        assert refused == 0 and "PermissionError" in result.stdout  # forks refused by the hook
    else:
        _needs(result, own_uid=True)
        # The runner itself is one of the max_processes.
        assert 1 <= refused < HOSTILE.max_processes and "BlockingIOError" in result.stdout
    _assert_contained(result, elapsed, HOSTILE)


def test_endless_fork_bomb_ends_with_its_wall_clock() -> None:
    code = "while True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    result, text, elapsed = _run(code)
    assert result.timed_out and "[timed out after 1.5 s; killed]" in text
    _assert_contained(result, elapsed, HOSTILE)


def test_subprocess_storm_is_capped() -> None:
    code = (
        "import subprocess\n"
        "procs = []\n"
        "try:\n"
        "    for _ in range(100):\n"
        "        procs.append(subprocess.Popen([sys.executable, '-c', 'import time; "
        "time.sleep(60)']))\n"
        "except OSError as err:\n"
        "    print('refused', len(procs), type(err).__name__, flush=True)\n"
        "time.sleep(60)\n"
    )
    result, _, elapsed = _run(code)
    _needs(result, own_uid=True)
    assert result.timed_out and 1 <= _count(result.stdout, "refused") < HOSTILE.max_processes
    _assert_contained(result, elapsed, HOSTILE)


def test_multiprocessing_storm_is_capped() -> None:
    code = (
        "import multiprocessing\n"
        "started = 0\n"
        "try:\n"
        "    for _ in range(100):\n"
        "        multiprocessing.Process(target=time.sleep, args=(60,)).start()\n"
        "        started += 1\n"
        "except OSError as err:\n"
        "    print('refused', started, type(err).__name__, flush=True)\n"
        "time.sleep(60)\n"
    )
    result, _, elapsed = _run(code)
    _needs(result, own_uid=True)
    assert result.timed_out and 1 <= _count(result.stdout, "refused") < HOSTILE.max_processes
    _assert_contained(result, elapsed, HOSTILE)


DAEMON = (
    "if os.fork() == 0:\n"
    "    os.setsid()\n"  # out of the process group the parent kills
    "    if os.fork() == 0:\n"
    "        time.sleep(60)\n"
    "    os._exit(0)\n"
    "print('parent done', flush=True)\n"
)


@pytest.mark.parametrize("isolation", ["auto", "off"])
def test_a_daemon_that_left_the_group_dies_with_the_run(isolation: str) -> None:
    config = HOSTILE.model_copy(update={"isolation": isolation, "timeout_s": 10.0})
    result, text, elapsed = _run(DAEMON, config)
    if isolation == "off":  # then only the uid of its own finds it
        _needs(result, own_uid=True)
    else:
        _needs(result, namespace=True)
    # The run ended with its code, not with the clock, though the daemon holds the pipes.
    assert (result.exit_code, result.timed_out) == (0, False), text
    assert "parent done" in result.stdout
    _assert_contained(result, elapsed, config)


def test_a_spinning_child_that_ignores_sigxcpu_and_outlives_its_parent() -> None:
    code = (
        "import signal\n"
        "if os.fork() == 0:\n"
        "    signal.signal(signal.SIGXCPU, signal.SIG_IGN)\n"
        "    while True:\n"
        "        pass\n"
        "time.sleep(60)\n"
    )
    result, text, elapsed = _run(code)
    assert result.timed_out, text
    _assert_contained(result, elapsed, HOSTILE)


def test_spinning_threads_that_ignore_sigxcpu_meet_the_hard_cpu_limit() -> None:
    config = HOSTILE.model_copy(update={"timeout_s": 20.0, "cpu_time_s": 1})
    code = (
        "import signal, threading\n"
        "signal.signal(signal.SIGXCPU, signal.SIG_IGN)\n"
        "def spin():\n"
        "    while True:\n"
        "        pass\n"
        "for _ in range(2):\n"
        "    threading.Thread(target=spin, daemon=True).start()\n"
        "spin()\n"
    )
    result, text, elapsed = _run(code, config)
    assert not result.timed_out and result.signal_name == "SIGKILL", text
    assert "CPU time limit of 1 s" in text  # the hard limit, a second of CPU time later
    _assert_contained(result, elapsed, config)


@pytest.fixture
def targets(tmp_path: Path) -> Iterator[dict[str, Path]]:
    """Places outside the run's folder hostile code may try: the shared temporary
    directories, the project tree, the host's home, /etc, and a world-writable folder and
    file of the host's."""
    name = f"pearl-hostile-{os.getpid()}-{time.monotonic_ns()}"
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    open_file = tmp_path / "open.txt"
    open_file.write_text("untouched")
    open_file.chmod(0o666)
    places = {
        "tmp": Path("/tmp") / name,
        "var_tmp": Path("/var/tmp") / name,
        "dev_shm": Path("/dev/shm") / name,
        "project": Path(__file__).resolve().parent / name,
        "home": Path.home() / name,
        "etc": Path("/etc") / name,
        "open_dir": open_dir / name,
        "open_file": open_file,
    }
    yield places
    for key, path in places.items():
        if key != "open_file":
            path.unlink(missing_ok=True)


@pytest.mark.parametrize("isolation", ["auto", "off"])
def test_writes_outside_its_directory_do_not_reach_the_host(
    isolation: str, targets: dict[str, Path]
) -> None:
    code = (
        f"targets = {json.dumps({k: str(v) for k, v in targets.items()})}\n"
        "for key, path in targets.items():\n"
        "    try:\n"
        "        with open(path, 'a') as f:\n"
        "            f.write('hostile')\n"
        "        print(key, 'wrote', flush=True)\n"
        "    except OSError as err:\n"
        "        print(key, 'refused', err.strerror, flush=True)\n"
        "open('scratch', 'w').write('mine')\n"
        "print('own folder', open('scratch').read(), flush=True)\n"
    )
    config = HOSTILE.model_copy(update={"isolation": isolation})
    result, text, elapsed = _run(code, config)
    if isolation == "off":  # the uid of its own alone: its files in /tmp & co are removed
        _needs(result, own_uid=True)
    else:
        _needs(result, namespace=True)
    assert result.exit_code == 0 and "own folder mine" in result.stdout, text
    contained = ["tmp", "var_tmp", "dev_shm", "project", "home", "etc"]
    if result.isolation == "namespace":  # everything is read-only there but its own tmpfs
        contained += ["open_dir"]
        assert targets["open_file"].read_text() == "untouched"
    for key in contained:
        assert not targets[key].exists(), (key, text)
    _assert_contained(result, elapsed, config)


def test_memory_hogs_in_children_and_in_tmpfs() -> None:
    config = HOSTILE.model_copy(update={"tmpfs_mb": 4})
    code = (
        "kids = []\n"
        "for _ in range(3):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        try:\n"
        "            hog = bytearray(512 * 2**20)\n"
        "        except MemoryError:\n"
        "            os._exit(3)\n"
        "        os._exit(0)\n"
        "    kids.append(pid)\n"
        "codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in kids]\n"
        "print('children', sum(code == 3 for code in codes), flush=True)\n"
        "written = 0\n"
        "try:\n"
        "    with open('/dev/shm/hog', 'wb') as f:\n"
        "        for _ in range(64):\n"
        "            f.write(b'x' * 2**20)\n"
        "            f.flush()\n"
        "            written += 1\n"
        "except OSError as err:\n"
        "    print('shm', written, err.strerror, flush=True)\n"
    )
    result, text, elapsed = _run(code, config)
    _needs(result, own_uid=True, namespace=True)
    assert _count(result.stdout, "children") == 3, text  # each child's allocation failed
    assert _count(result.stdout, "shm") <= 4 and "No space left on device" in result.stdout
    _assert_contained(result, elapsed, config)


@pytest.fixture
def listening_port() -> Iterator[tuple[socket.socket, int]]:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        yield server, server.getsockname()[1]


def test_network_attempts_fail(listening_port: tuple[socket.socket, int]) -> None:
    server, port = listening_port
    code = (
        "import socket\n"
        f"for where in [('127.0.0.1', {port}), ('1.1.1.1', 53), ('8.8.8.8', 443)]:\n"
        "    try:\n"
        "        socket.create_connection(where, timeout=1).close()\n"
        "        print('connected', where, flush=True)\n"
        "    except OSError as err:\n"
        "        print('refused', where, type(err).__name__, flush=True)\n"
        "for attempt in [lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM)"
        ".sendto(b'x', ('8.8.8.8', 53)), lambda: socket.getaddrinfo('example.com', 80)]:\n"
        "    try:\n"
        "        attempt()\n"
        "        print('sent', flush=True)\n"
        "    except OSError as err:\n"
        "        print('refused', type(err).__name__, flush=True)\n"
    )
    result, text, elapsed = _run(code)
    assert "connected" not in result.stdout and "sent" not in result.stdout, text
    assert result.stdout.count("refused") == 5, text
    with pytest.raises(BlockingIOError):  # nothing ever reached the host's listener
        server.accept()
    _assert_contained(result, elapsed, HOSTILE)


def test_an_output_flood_from_many_processes_is_cut() -> None:
    code = "for _ in range(3):\n    os.fork()\nwhile True:\n    os.write(1, b'x' * 65536)\n"
    result, text, elapsed = _run(code)
    assert result.timed_out and result.output_truncated
    assert len(text) <= HOSTILE.max_output_chars
    _assert_contained(result, elapsed, HOSTILE)


def test_a_fork_bomb_does_not_starve_the_runs_beside_it() -> None:
    bomb = "while True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    ordinary = (
        "time.sleep(0.3)\n"  # while the bomb is at its cap
        "kids = [os.fork() for _ in range(3)]\n"
        "if 0 in kids:\n"
        "    os._exit(0)\n"
        "for pid in kids:\n"
        "    os.waitpid(pid, 0)\n"
        "print('ok', flush=True)\n"
    )

    patient = HOSTILE.model_copy(update={"timeout_s": 20.0})  # slow beside a bomb, not stuck

    async def go() -> list[SandboxResult]:
        bombs, others = Sandbox(HOSTILE), Sandbox(patient)
        runs = [bombs.run(PRELUDE + bomb), *(others.run(PRELUDE + ordinary) for _ in range(2))]
        return list(await asyncio.gather(*runs))

    start = time.monotonic()
    bombed, *others = asyncio.run(go())
    _needs(bombed, own_uid=True)
    assert len({bombed.uid, *(o.uid for o in others)}) == 3  # a uid, and so a cap, each
    assert all(o.exit_code == 0 and o.stdout.endswith("ok\n") for o in others), others
    _assert_contained(bombed, time.monotonic() - start, patient)


def test_user_drop_is_mandatory_when_asked() -> None:
    config = HOSTILE.model_copy(update={"user": "drop"})
    if os.geteuid() != 0:
        with pytest.raises(SandboxError, match="uid of its own"):
            _run("pass", config)
        return
    result, _, _ = _run("print(os.getuid(), os.getgid(), os.getgroups())", config)
    uid = result.uid
    assert uid is not None and config.uid_min <= uid < config.uid_min + config.uid_count
    assert result.stdout.splitlines()[1] == f"{uid} {uid} []"


def test_isolation_namespace_is_mandatory_when_asked() -> None:
    config = HOSTILE.model_copy(update={"isolation": "namespace"})
    try:
        result, _, _ = _run("print(os.getpid())", config)
    except SandboxError as err:
        assert "cannot isolate" in str(err)
        return
    assert result.isolation == "namespace"
    assert result.stdout.splitlines()[1] == "2"  # under the namespace's init


def _may_unshare_mounts() -> bool:
    probe = "import ctypes, sys; sys.exit(ctypes.CDLL(None).unshare(0x20000) != 0)"
    return subprocess.run([sys.executable, "-c", probe], check=False).returncode == 0


def test_remounting_each_mount_read_only(tmp_path: Path) -> None:
    """The fallback for kernels without mount_setattr, in a mount namespace of its own."""
    if not _may_unshare_mounts():
        pytest.skip("unshare(CLONE_NEWNS) is not permitted here")
    script = (
        "import ctypes, importlib.util, os, sys\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "assert libc.unshare(0x20000) == 0\n"
        "assert libc.mount(None, b'/', None, 0x4000 | (1 << 18), None) == 0\n"
        f"spec = importlib.util.spec_from_file_location('child', {str(CHILD)!r})\n"
        "child = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(child)\n"
        "child.remount_each_read_only()\n"
        "for path in sys.argv[1:]:\n"
        "    try:\n"
        "        open(path, 'w')\n"
        "        print('wrote', path)\n"
        "    except OSError as err:\n"
        "        print(err.strerror)\n"
    )
    paths = [tmp_path / "x", Path("/dev/shm") / f"pearl-remount-{os.getpid()}"]
    done = subprocess.run(
        [sys.executable, "-c", script, *map(str, paths)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["Read-only file system"] * 2
    assert not any(path.exists() for path in paths)


def test_no_new_privileges_after_the_drop() -> None:
    result, text, elapsed = _run("print(open('/proc/self/status').read())")
    _needs(result, own_uid=True)
    fields = dict(line.split(":\t", 1) for line in result.stdout.splitlines() if ":\t" in line)
    assert fields["NoNewPrivs"] == "1"
    effective = int(fields["CapEff"], 16)
    assert effective & ~(1 << 2) == 0, text  # at most CAP_DAC_READ_SEARCH: read, never write
    _assert_contained(result, elapsed, HOSTILE)
