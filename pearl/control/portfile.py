"""The port file: how an agent finds and authenticates to the coordinator.

``<run_dir>/control/port.json``, mode 0600, written atomically (temporary file in the same
directory, fsync, rename) so a reader never sees half a file. It holds the MPI port name
(``MPI.Open_port``), the knock address (host:port of the coordinator's TCP rendezvous, see
:mod:`pearl.control.rendezvous`) and a random token from :mod:`secrets`. A reader refuses a
file that group or others can read: the token is the only credential.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from pearl.io.documents import InputError
from pearl.io.untrusted import UntrustedInput, loads_json

PORT_FILE_VERSION = 1


@dataclass(frozen=True)
class PortInfo:
    port: str  # MPI port name
    knock_host: str
    knock_port: int
    token: str
    pid: int = 0


def port_file_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / "control" / "port.json"


def new_token() -> str:
    return secrets.token_urlsafe(32)


def write_port_file(run_dir: str | Path, info: PortInfo) -> Path:
    path = port_file_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    body = json.dumps({"v": PORT_FILE_VERSION, **info.__dict__}).encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, body)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


def remove_port_file(run_dir: str | Path) -> None:
    port_file_path(run_dir).unlink(missing_ok=True)


MAX_PORT_FILE_BYTES = 64 * 1024  # an MPI port name is a few hundred bytes
MAX_FIELD_CHARS = 8192


def read_port_file(run_dir: str | Path) -> PortInfo:
    """Read and check the port file (as pearl reads untrusted text: bounded, finite); an
    ``InputError`` names the field and what is wrong (``FileNotFoundError`` while there is
    none yet)."""
    path = port_file_path(run_dir)
    st = path.stat()
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise InputError(path, "", f"mode {oct(st.st_mode & 0o777)} is open to others, need 0600")
    try:
        obj = loads_json(path.read_bytes(), max_bytes=MAX_PORT_FILE_BYTES)
    except UntrustedInput as err:
        raise InputError(path, err.field, err.problem) from None
    if not isinstance(obj, dict) or obj.get("v") != PORT_FILE_VERSION:
        raise InputError(path, "v", f"expected version {PORT_FILE_VERSION}")
    for name in ("port", "knock_host", "token"):
        value = obj.get(name)
        if not isinstance(value, str) or not 0 < len(value) <= MAX_FIELD_CHARS:
            problem = f"missing, or not a text of 1-{MAX_FIELD_CHARS} characters"
            raise InputError(path, name, problem)
    for name, most in (("knock_port", 65535), ("pid", 2**22)):
        value = obj.get(name)
        if type(value) is not int or not 0 <= value <= most:
            raise InputError(path, name, f"missing, or not an integer from 0 to {most}")
    fields = ("port", "knock_host", "knock_port", "token", "pid")
    return PortInfo(**{k: obj[k] for k in fields})


def wait_port_file(run_dir: str | Path, timeout_s: float) -> PortInfo:
    """Poll for the port file (the coordinator may start after the agent)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return read_port_file(run_dir)
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no port file at {port_file_path(run_dir)}") from None
            time.sleep(0.05)
