"""The text of a streamed response, delta by delta, as the tokens arrive.

Each engine event gives the stream its new tokens at once (ids, logprobs, versions), and
as much of their text as is final: the text of a token that ends inside a UTF-8 character
waits for the rest of the character, and the last ``len(longest stop string) - 1``
characters wait until the sequence finishes, since they may be the start of a stop string
(which the response leaves out, as vLLM's detokenizer does). At the finish everything
left goes out, cut before the stop string that ended it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from pearl.engines.reference.generation import Detokenizer, Generation, text_of


@dataclass(frozen=True)
class Delta:
    text: str  # the new final text
    start: int  # the new tokens: g.token_ids[start:end]
    end: int
    finished: bool


async def deltas(g: Generation, tok: Detokenizer, stops: Sequence[str]) -> AsyncIterator[Delta]:
    holdback = max((len(s) for s in stops), default=1) - 1
    sent_text, sent_tokens = "", 0
    async for event in g.events():
        text = text_of(tok, g.token_ids, g.stop_reason)
        if event.finish is None:
            if text.endswith("\ufffd"):
                text = sent_text
            elif holdback:
                text = text[: max(len(sent_text), len(text) - holdback)]
        yield Delta(text[len(sent_text) :], sent_tokens, len(g.token_ids), event.finish is not None)
        sent_text, sent_tokens = text, len(g.token_ids)
