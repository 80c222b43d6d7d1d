"""The KV side channel between a prefill instance and a decode instance.

What NIXL does between GPUs, done here over TCP: the prefill instance listens on its own
side-channel port (``--kv-port``, vLLM's ``VLLM_NIXL_SIDE_CHANNEL_PORT``) and the decode
instance, given the prefill's ``kv_transfer_params``, connects and asks for one held
prefill by ``remote_request_id``. The producer answers with the prompt's keys, values and
last-position logits, serialised by ``safetensors``, and frees them. One exchange:

- the request: one JSON line ``{"engine_id": ..., "request_id": ...}``;
- the answer: one JSON line ``{"ok": true, "bytes": N}`` then N bytes of safetensors
  (``keys``, ``values``: ``[layers, tokens, kv_heads, head_dim]``; ``logits``: ``[vocab]``),
  or ``{"ok": false, "error": "..."}``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from pearl.io.untrusted import loads_json

Tensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
MAX_LINE_BYTES = 4096


class TransferError(RuntimeError):
    """A pull that failed: the peer is unreachable, unknown, or has no such prefill."""


def serve(
    engine_id: str, take: Callable[[str], Awaitable[Tensors]]
) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
    """The side channel's connection handler; ``take(request_id)`` gives the held KV
    (KeyError if there is none)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await reader.readline()
            try:
                ask = loads_json(line, max_bytes=MAX_LINE_BYTES)
                if not isinstance(ask, dict):
                    raise ValueError("the request is not a JSON object")
                rid = str(ask["request_id"])
                if ask.get("engine_id") != engine_id:
                    raise KeyError(f"this is engine {engine_id!r}, not {ask.get('engine_id')!r}")
                keys, values, logits = await take(rid)
            except (ValueError, KeyError, TypeError) as err:
                problem = str(err) if not isinstance(err, KeyError) else str(err.args[0])
                writer.write(json.dumps({"ok": False, "error": problem}).encode() + b"\n")
                return
            data = st_save({"keys": keys, "values": values, "logits": logits})
            writer.write(json.dumps({"ok": True, "bytes": len(data)}).encode() + b"\n")
            writer.write(data)
            await writer.drain()
        finally:
            writer.close()

    return handle


async def pull(
    host: str,
    port: int,
    engine_id: str,
    request_id: str,
    *,
    max_bytes: int,
    timeout_s: float = 30.0,
) -> tuple[Tensors, int]:
    """The held prefill ``request_id`` of engine ``engine_id`` at ``host:port``, and its
    size in bytes; ``TransferError`` if it cannot be had, or if the peer announces more
    than ``max_bytes`` (nothing of it is read)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except (OSError, TimeoutError) as err:
        raise TransferError(f"cannot reach the KV side channel {host}:{port}: {err}") from None
    try:
        ask = {"engine_id": engine_id, "request_id": request_id}
        writer.write(json.dumps(ask).encode() + b"\n")
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), timeout_s)
        head = loads_json(line or b"{}", max_bytes=MAX_LINE_BYTES)
        if not isinstance(head, dict) or not head.get("ok"):
            error = head.get("error", "no answer") if isinstance(head, dict) else "no answer"
            raise TransferError(f"{host}:{port}: {str(error)[:500]}")
        size = head.get("bytes")
        if type(size) is not int or not 0 < size <= max_bytes:
            raise TransferError(
                f"{host}:{port}: announces {str(size)[:40]} bytes, not a prefill's (at most "
                f"{max_bytes} for this prompt)"
            )
        data = await asyncio.wait_for(reader.readexactly(size), timeout_s)
    except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError) as err:
        raise TransferError(f"KV pull from {host}:{port} failed: {err}") from None
    finally:
        writer.close()
    t = st_load(data)
    return (t["keys"], t["values"], t["logits"]), len(data)
