"""Helpers of the HTTP fuzz tests: hostile request bodies (hypothesis strategies), the
property every answer must have, and a raw-socket client for what httpx will not send (a
Content-Length that lies, a body that never comes, a chunked body past the limit).

The property (``check_answer``): a 2xx for a request that happens to be valid, else a
4xx with vLLM's error body ``{"error": {"message", "type", "param", "code"}}`` whose
``code`` is the status; never a 5xx, never a traceback, never an answer later than
``ANSWER_BOUND_S``. After each example a valid request must still succeed within
``PROMPT_S`` (the tests' ``still_serving``)."""

from __future__ import annotations

import json
import math
import re
import socket
import time
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

import httpx
from hypothesis import currently_in_test_context, event
from hypothesis import strategies as st

ANSWER_BOUND_S = 20.0  # no answer to a hostile request may take longer
PROMPT_S = 5.0  # a valid request after the hostile ones is answered within this
VOCAB = 512  # the tiny model's (tests/conftest.py's tiny_model_dir)
MAX_MODEL_LEN = 4096

# -- the property -------------------------------------------------------------------------


def error_of(r: httpx.Response) -> dict[str, Any]:
    """The error object of a 4xx answer in vLLM's shape (asserted)."""
    assert 400 <= r.status_code < 500, f"{r.status_code}: {r.text[:500]}"
    assert r.headers.get("content-type", "").startswith("application/json"), r.headers
    doc = r.json()
    assert isinstance(doc, dict) and set(doc) == {"error"}, doc
    err = doc["error"]
    assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == r.status_code, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"].endswith("Error"), err
    assert err["param"] is None or isinstance(err["param"], str), err
    return err


def check_answer(r: httpx.Response, elapsed_s: float) -> None:
    """2xx, or a 4xx in vLLM's error shape; never a 5xx or a traceback; within the bound."""
    assert elapsed_s < ANSWER_BOUND_S, f"answered after {elapsed_s:.1f} s"
    assert "Traceback (most recent call last)" not in r.text[:100_000], r.text[:2000]
    if 200 <= r.status_code < 300:
        return
    error_of(r)  # a 3xx as well: no route redirects


def send(client: httpx.Client, method: str, url: str, **kw: Any) -> httpx.Response:
    """One request, its answer checked (``check_answer``)."""
    t0 = time.monotonic()
    r = client.request(method, url, timeout=ANSWER_BOUND_S, **kw)
    check_answer(r, time.monotonic() - t0)
    if currently_in_test_context():  # --hypothesis-show-statistics: how many were valid
        event(f"HTTP {r.status_code}")
    return r


def post_json(client: httpx.Client, url: str, doc: Any, **kw: Any) -> httpx.Response:
    """POST ``doc`` as JSON text, NaN and Infinity included (what httpx's ``json=`` refuses)."""
    body = json.dumps(doc, allow_nan=True).encode()
    headers = {"content-type": "application/json", **kw.pop("headers", {})}
    return send(client, "POST", url, content=body, headers=headers, **kw)


def metric(text: str, name: str) -> float:
    """The sum of a Prometheus metric's samples in ``text`` (0 if it has none)."""
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", re.M)
    return sum(float(v) for v in pattern.findall(text))


def wait_until(check: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.05)


# -- strategies -----------------------------------------------------------------------------

EXTREME_INTS = [0, -1, 1, 2**31, 2**63 - 1, 2**63, -(2**63) - 1, 2**64, 10**18, 10**30]
EXTREME_FLOATS = [0.0, -0.0, 1e-300, 5e-324, 1e308, -1e308, math.nan, math.inf, -math.inf]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from(EXTREME_INTS),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(EXTREME_FLOATS),
    st.text(max_size=12),
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=10,
)


class FieldValues:
    """A request field's values: ``good`` ones (valid on their own) and ``bad`` ones (each
    a value, or a strategy of values)."""

    def __init__(self, good: st.SearchStrategy[Any], *bad: Any) -> None:
        self.good = good
        given = [b for b in bad if isinstance(b, st.SearchStrategy)]
        values = [b for b in bad if not isinstance(b, st.SearchStrategy)]
        self.bad: st.SearchStrategy[Any] = st.one_of(
            json_values, *given, *([st.sampled_from(values)] if values else [])
        )

    @property
    def any(self) -> st.SearchStrategy[Any]:
        """Good values most often, bad ones, and any JSON value at all."""
        return st.one_of(self.good, self.good, self.bad)


texts = st.text(max_size=40)
words = st.text(min_size=1, max_size=40)
in_vocab = st.integers(0, VOCAB - 1)
token_ids = st.one_of(
    in_vocab, st.integers(VOCAB, VOCAB + 64), st.sampled_from([-1, 2**63, 10**30])
)
id_lists = st.lists(in_vocab, min_size=1, max_size=12)
PROMPT = FieldValues(
    st.one_of(
        words,
        id_lists,
        st.lists(words, min_size=1, max_size=3),
        st.lists(id_lists, min_size=1, max_size=3),
    ),
    st.lists(token_ids, max_size=12),
    "", [], [[]], [1, "a"], [[1], []],
    [5] * (MAX_MODEL_LEN + 1),  # longer than the model takes
    [[1]] * 300,  # more prompts than one request takes
)  # fmt: skip
KV_PULLS = [  # a decode's pull from (engine id, block ids, host, port): none can succeed
    ("e", [0], "127.0.0.1", 1), ("x" * 600, [0], "127.0.0.1", 1), ("e", [-1], "::1", 1),
    ("e", [0], "", 1), ("e", [0], "\x00", 1), ("e", [0], "a b", 1),
    ("e", [0], "1.2.3.4.5", 1), ("e", [0], "127.0.0.1", 0), ("e", [0], "127.0.0.1", -1),
    ("e", [0], "127.0.0.1", 65536), ("e", [0], "127.0.0.1", 2**63),
]  # fmt: skip
KV = FieldValues(
    st.sampled_from([{"do_remote_decode": True}, {"do_remote_decode": False}]),
    {"do_remote_prefill": True},  # a decode without the prefill's fields
    {"do_remote_decode": True, "do_remote_prefill": True},
    *[
        {
            "do_remote_prefill": True,
            "remote_engine_id": engine_id,
            "remote_request_id": "r",
            "remote_block_ids": blocks,
            "remote_host": host,
            "remote_port": port,
            "tp_size": 1,
        }
        for engine_id, blocks, host, port in KV_PULLS
    ],
)
SAMPLING: dict[str, FieldValues] = {
    "model": FieldValues(texts),
    "max_tokens": FieldValues(st.integers(1, 8), *EXTREME_INTS, 2.5, "3", True),
    "temperature": FieldValues(st.floats(0.0, 2.0), *EXTREME_FLOATS, 100.0, 101.0, "1"),
    "top_p": FieldValues(st.floats(0.01, 1.0), *EXTREME_FLOATS, 1.5),
    "seed": FieldValues(st.integers(-(2**63), 2**63 - 1), 2**63, -(2**63) - 1, 10**30, 1.5),
    "n": FieldValues(st.just(1), 0, 2, 10**9),
    "stop": FieldValues(
        st.one_of(words, st.lists(words, max_size=4)), "", [""], ["x"] * 65, "x" * 2000
    ),
    "stop_token_ids": FieldValues(st.lists(in_vocab, max_size=4), [VOCAB], [-1], [1] * 1025),
    "ignore_eos": FieldValues(st.booleans()),
    "min_tokens": FieldValues(st.integers(0, 1), 9, -1, 10**30),
    "stream": FieldValues(st.booleans()),
    "stream_options": FieldValues(st.fixed_dictionaries({"include_usage": st.booleans()}), 5, []),
    "kv_transfer_params": KV,
    "return_token_ids": FieldValues(st.booleans()),
    "return_tokens_as_token_ids": FieldValues(st.booleans()),
    "unknown_field": FieldValues(json_values),
}
COMPLETION = {
    **SAMPLING,
    "logprobs": FieldValues(st.integers(0, 5), 21, *EXTREME_INTS),
    "echo": FieldValues(st.just(False), True),
}
content = FieldValues(
    st.one_of(
        texts, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}), max_size=2)
    )
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system"]), "content": content.good}
)
odd_message = st.fixed_dictionaries(
    {},
    optional={
        "role": FieldValues(st.sampled_from(["user", "assistant", "system", "tool"])).any,
        "content": content.any,
        "tool_calls": json_values,
        "name": json_values,
    },
)
tools = st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries({"name": words})}
)
MESSAGES = FieldValues(
    st.lists(message, min_size=1, max_size=3), [], st.lists(odd_message, max_size=3)
)
CHAT = {
    **SAMPLING,
    "tools": FieldValues(st.lists(tools, max_size=2), st.lists(json_values, max_size=2)),
    "tool_choice": FieldValues(st.sampled_from(["auto", "none"])),
    "logprobs": FieldValues(st.booleans()),
    "top_logprobs": FieldValues(st.integers(0, 5), 21, *EXTREME_INTS),
    "max_completion_tokens": FieldValues(st.integers(1, 8), *EXTREME_INTS),
    "add_generation_prompt": FieldValues(st.booleans()),
}  # fmt: skip
ROUTER_REFUSES = frozenset({"stop", "stream", "stream_options", "kv_transfer_params"})


def bodies(
    required: dict[str, FieldValues],
    fields: dict[str, FieldValues],
    *,
    skip: frozenset[str] = frozenset(),
) -> st.SearchStrategy[dict[str, Any]]:
    """Request bodies of ``fields``: half of them of good values only (valid, or refused
    for what the values mean together), half with any value at all."""
    optional = {k: f for k, f in fields.items() if k not in skip}
    good = st.fixed_dictionaries(
        {k: f.good for k, f in required.items()}, optional={k: f.good for k, f in optional.items()}
    )
    hostile = st.fixed_dictionaries(
        {k: f.any for k, f in required.items()}, optional={k: f.any for k, f in optional.items()}
    )
    return st.one_of(good, hostile)


completion_bodies = bodies({"prompt": PROMPT}, COMPLETION)
chat_bodies = bodies({"messages": MESSAGES}, CHAT)
# the router refuses stop strings and streams (a 400 by design): valid bodies without them
router_completion_bodies = bodies({"prompt": PROMPT}, COMPLETION, skip=ROUTER_REFUSES)
router_chat_bodies = bodies({"messages": MESSAGES}, CHAT, skip=ROUTER_REFUSES)


def bounded(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with a small ``max_tokens`` where it gives none, so that a generated valid
    chat request does not run to the model's full length."""
    unbounded = body.get("max_tokens") is None and body.get("max_completion_tokens") is None
    return {**body, "max_tokens": 4} if unbounded else body


@st.composite
def mutated(draw: st.DrawFn, base: bytes) -> bytes:
    """``base`` with a few bytes flipped, inserted, deleted or cut, or a hostile body of
    its own: deep nesting, an integer of thousands of digits, invalid UTF-8, NaN."""
    kind = draw(st.sampled_from(["edit", "edit", "edit", "hostile", "binary"]))
    if kind == "binary":
        return draw(st.binary(max_size=64))
    if kind == "hostile":
        depth = draw(st.integers(30, 5000))
        return draw(
            st.sampled_from(
                [
                    b"[" * depth,
                    b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}",
                    b'{"a":' * depth + b"1" + b"}" * depth,
                    b'{"prompt": [1], "max_tokens": ' + b"9" * depth + b"}",
                    b'{"prompt": "\xff\xfe\xc3"}',
                    b'{"prompt": [1], "temperature": NaN}',
                    b'{"prompt": [1], "top_p": -Infinity}',
                    b'{"prompt": [1], "seed": 1e999}',
                    b"\xef\xbb\xbf" + base,  # a byte-order mark
                    base + b"garbage",
                    base * 2,
                ]
            )
        )
    data = bytearray(base)
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data)))
        op = draw(st.sampled_from(["flip", "insert", "delete", "cut"]))
        if op == "flip" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=4))
        elif op == "delete":
            del data[at : at + draw(st.integers(1, 4))]
        else:
            del data[at:]
    return bytes(data)


# -- a raw HTTP/1.1 client ------------------------------------------------------------------


def open_raw(url: str, method: str, path: str, headers: dict[str, str]) -> socket.socket:
    """A connection with the request line and ``headers`` sent, and nothing else."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 80), timeout=10)
    lines = [f"{method} {path} HTTP/1.1", f"host: {parts.netloc}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
    return sock


def send_parts(sock: socket.socket, parts: Iterable[bytes]) -> bool:
    """Send ``parts``; False once the server stopped taking them (it answered already)."""
    try:
        for p in parts:
            sock.sendall(p)
    except (BrokenPipeError, ConnectionResetError):
        return False
    return True


def read_answer(sock: socket.socket, timeout_s: float = 10.0) -> httpx.Response:
    """The server's answer on ``sock``, read to its Content-Length (or the close)."""
    sock.settimeout(timeout_s)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed before an answer: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in header_lines)
    lowered = {k.lower(): v for k, v in headers.items()}
    size = int(lowered.get("content-length", "-1"))
    while size < 0 or len(body) < size:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return httpx.Response(int(status_line.split()[1]), headers=headers, content=body)


def chunked(data_parts: Iterable[bytes]) -> Iterable[bytes]:
    """``data_parts`` in HTTP/1.1 chunked encoding, the last chunk included."""
    for p in data_parts:
        yield f"{len(p):x}\r\n".encode() + p + b"\r\n"
    yield b"0\r\n\r\n"
