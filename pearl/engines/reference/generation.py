"""One choice of a response, as its tokens arrive from the engine thread; its JSON shapes.

A :class:`Generation` is the asyncio side of one sequence: the engine thread hands it
:class:`TokenEvent` s (thread-safely, onto the server's event loop), and the route reads
them, for a streamed response as they come, else until the finish. It keeps what the
response reports: token ids, logprobs, weight versions, the finish reason and, for a
prefill, the ``kv_transfer_params`` the decode instance needs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pearl.engines.reference.sequence import TokenEvent


class Detokenizer(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...
    def token_text(self, token_id: int) -> str: ...


@dataclass
class Generation:
    loop: asyncio.AbstractEventLoop
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    on_finish: Callable[[], None] | None = None  # called once the finish is recorded
    _queue: asyncio.Queue[TokenEvent] = field(default_factory=asyncio.Queue)

    def emit(self, event: TokenEvent) -> None:
        """From the engine thread."""
        self.loop.call_soon_threadsafe(self._queue.put_nowait, event)

    async def events(self) -> AsyncIterator[TokenEvent]:
        """Each event as it comes, recorded, until the finishing one."""
        while self.finish_reason is None:
            event = await self._queue.get()
            self.token_ids += event.token_ids
            self.logprobs += event.logprobs
            self.top_logprobs += event.top_logprobs
            self.versions += event.versions
            if event.finish is not None:
                self.finish_reason = event.finish.value
                self.stop_reason = event.stop_reason
                self.kv_transfer_params = event.kv_transfer_params
                if self.on_finish is not None:
                    self.on_finish()
            yield event

    async def finished(self) -> None:
        async for _ in self.events():
            pass


def text_of(tok: Detokenizer, ids: list[int], stop_reason: int | str | None) -> str:
    """The text of ``ids``, cut before a stop string that ended it (vLLM leaves the stop
    string out)."""
    text = tok.decode(ids, skip_special_tokens=True)
    if isinstance(stop_reason, str) and stop_reason in text:
        text = text[: text.index(stop_reason)]
    return text


def token_label(tok: Detokenizer, token_id: int, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else tok.token_text(token_id)


def completion_logprobs(
    tok: Detokenizer, g: Generation, start: int, as_ids: bool, text_offset_0: int = 0
) -> dict[str, Any]:
    """The ``logprobs`` of a completion choice, OpenAI's legacy shape, from token ``start``."""
    ids = g.token_ids[start:]
    tokens = [token_label(tok, t, as_ids) for t in ids]
    offsets, at = [], text_offset_0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {
        "text_offset": offsets,
        "token_logprobs": g.logprobs[start:],
        "tokens": tokens,
        "top_logprobs": [
            {token_label(tok, t, as_ids): lp for t, lp in top.items()} or None
            for top in g.top_logprobs[start:]
        ],
    }


def chat_logprobs(tok: Detokenizer, g: Generation, start: int, as_ids: bool) -> dict[str, Any]:
    """The ``logprobs`` of a chat choice (``content``: one entry per token)."""

    def entry(t: int, lp: float) -> dict[str, Any]:
        label = token_label(tok, t, as_ids)
        return {"token": label, "logprob": lp, "bytes": list(label.encode())}

    content = []
    for t, lp, top in zip(
        g.token_ids[start:], g.logprobs[start:], g.top_logprobs[start:], strict=True
    ):
        item = entry(t, lp)
        item["top_logprobs"] = [entry(i, v) for i, v in top.items()]
        content.append(item)
    return {"content": content}
