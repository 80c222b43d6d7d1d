"""One serving instance of the reference engine: model, tokenizer, engine core, and the
request rules the routes share (prompt checks, sampling, pause, weight loads)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from fastapi import Request

from pearl.engines.protocol import (
    MAX_BODY_BYTES,
    MIN_TEMPERATURE,
    ChatCompletionRequest,
    CompletionRequest,
    parse_json_body,
)
from pearl.engines.reference.config import load_config
from pearl.engines.reference.engine import EngineConfig, EngineCore
from pearl.engines.reference.errors import BadRequestError
from pearl.engines.reference.metrics import EngineMetrics
from pearl.engines.reference.model import DTYPES, CausalLM, WeightError
from pearl.engines.reference.sequence import SamplingParams
from pearl.engines.reference.tokenizer import Tokenizer
from pearl.engines.reference.tokenizer import load as load_tokenizer
from pearl.engines.reference.weights import read_weights
from pearl.engines.reference.weights_push import WeightPush
from pearl.io.documents import InputError

T = TypeVar("T")
VERSION = "pearl-reference-0.1.0"
MAX_LOGPROBS = 20
OFFLOAD_CHARS = 16_384  # prompt text this long is tokenized off the event loop
# a prompt text longer than max_model_len times this cannot fit the model (no tokenizer
# packs 64 characters a token on average): refused before it is tokenized, which for a few
# MiB of text takes seconds (a long run of one character: minutes)
MAX_CHARS_PER_TOKEN = 64


async def encode_texts(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    """The token ids of each text (``Tokenizer.encode``'s); long texts on a worker thread
    by the tokenizers library's batch call, which releases the GIL, so that the event loop
    goes on serving while a few MiB of text are tokenized."""
    if sum(len(t) for t in texts) <= OFFLOAD_CHARS:
        return [tokenizer.encode(t) for t in texts]
    batch = await asyncio.to_thread(tokenizer.backend.encode_batch, texts, add_special_tokens=False)
    return [list(e.ids) for e in batch]


@dataclass(frozen=True)
class ServeOptions:
    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    kv_port: int | None = None  # the KV side channel (prefill -> decode); None: no PD
    engine_id: str = "0"
    served_model_name: str | None = None
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    kv_cache_tokens: int = 65536
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    dtype: str | None = None  # None: the model's
    threads: int | None = None
    prefix_caching: bool = True
    kv_lease_s: float = 30.0


class Instance:
    def __init__(self, opts: ServeOptions) -> None:
        if opts.threads:
            torch.set_num_threads(opts.threads)
        self.opts = opts
        self.model_dir = Path(opts.model)
        self.cfg = load_config(self.model_dir)
        self.tokenizer: Tokenizer = load_tokenizer(self.model_dir)
        dtype = DTYPES[opts.dtype or self.cfg.torch_dtype]
        self.model = CausalLM(self.cfg, dtype)
        self.model.load(read_weights(self.model_dir))
        self.max_model_len = opts.max_model_len or self.cfg.max_position_embeddings
        cache_tokens = (opts.kv_cache_tokens // opts.block_size) * opts.block_size
        if cache_tokens < self.max_model_len:
            # as vLLM: one sequence of the longest length must fit, else it could never run
            raise InputError(
                "--kv-cache-tokens",
                "kv_cache_tokens",
                f"{cache_tokens} tokens cannot hold one sequence of max_model_len "
                f"{self.max_model_len}; give more, or a smaller --max-model-len",
            )
        self.served_name = opts.served_model_name or str(self.model_dir)
        self.engine_id = opts.engine_id
        self.kv_host = opts.host
        self.kv_port = opts.kv_port
        self.version = VERSION
        self.vocab_size = self.cfg.vocab_size
        self.metrics = EngineMetrics(self.served_name, opts.engine_id)
        eos = set(self.cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.core = EngineCore(
            self.model,
            EngineConfig(
                max_model_len=self.max_model_len,
                num_blocks=max(1, opts.kv_cache_tokens // opts.block_size),
                block_size=opts.block_size,
                max_num_seqs=opts.max_num_seqs,
                max_num_batched_tokens=opts.max_num_batched_tokens,
                prefix_caching=opts.prefix_caching,
                kv_lease_s=opts.kv_lease_s,
            ),
            self.metrics,
            eos_token_ids=sorted(eos),
            detokenize=lambda ids: self.tokenizer.decode(list(ids)),
        )
        self.push = WeightPush(self)
        self.paused = False
        self.dir_version = 0  # the version given to the model directory's weights when read
        self.live_ids: set[str] = set()  # request ids with a response in progress

    # -- running things on the engine thread ---------------------------------------------

    async def run(self, fn: Callable[[], T]) -> T:
        return await asyncio.wrap_future(self.core.call(fn))

    async def json_body(self, request: Request) -> dict[str, Any]:
        """The body of a route that reads it by hand, parsed as untrusted JSON (an empty
        body is ``{}``); a 400 naming the field if it is not a JSON object."""
        raw = await request.body()
        body = await parse_json_body(raw or b"{}", MAX_BODY_BYTES)
        if not isinstance(body, dict):
            raise BadRequestError("body: a JSON object is required", "body")
        return body

    # -- requests ------------------------------------------------------------------------

    def kv_shape(self, num_tokens: int) -> tuple[int, int, int, int]:
        c = self.cfg
        return (c.num_hidden_layers, num_tokens, c.num_key_value_heads, c.head_dim)

    def kv_transfer_bytes(self, num_tokens: int) -> int:
        """The most a prefill of ``num_tokens`` may take on the KV side channel: its keys,
        values and logits at 8 bytes a number (the widest dtype), and 64 KiB of header."""
        layers, tokens, heads, dim = self.kv_shape(num_tokens)
        return 8 * (2 * layers * tokens * heads * dim + self.vocab_size) + 65536

    async def completion_prompts(self, body: CompletionRequest) -> list[list[int]]:
        p = body.prompt
        if isinstance(p, str):
            self._check_text(p, "prompt")
            prompts = await encode_texts(self.tokenizer, [p])
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]  # type: ignore[arg-type]
        elif p and all(isinstance(x, str) for x in p):
            for text in p:
                self._check_text(text, "prompt")  # type: ignore[arg-type]
            prompts = await encode_texts(self.tokenizer, list(p))  # type: ignore[arg-type]
        elif p and all(isinstance(x, list) for x in p):
            prompts = [list(x) for x in p]  # type: ignore[arg-type]
        else:
            raise BadRequestError(
                "prompt: a text, a list of token ids, or a list of either (not mixed)", "prompt"
            )
        if not prompts:
            raise BadRequestError("prompt: empty", "prompt")
        for ids in prompts:
            self._check_prompt(ids)
        return prompts

    async def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        """The conversation's prompt, its template rendered on a worker thread (a long
        conversation takes a while; the GIL is let go every few ms)."""
        try:
            text = await asyncio.to_thread(
                self.tokenizer.apply_chat_template,
                body.messages,
                tools=body.tools,
                add_generation_prompt=body.add_generation_prompt,
            )
        except Exception as err:  # the template rejected the conversation
            raise BadRequestError(f"messages: {_shown(err)}", "messages") from None
        self._check_text(text, "messages")
        (ids,) = await encode_texts(self.tokenizer, [text])
        self._check_prompt(ids)
        return ids

    def _check_text(self, text: str, param: str) -> None:
        most = self.max_model_len * MAX_CHARS_PER_TOKEN
        if len(text) > most:
            raise BadRequestError(
                f"{param}: {len(text)} characters cannot fit this model's maximum context "
                f"length of {self.max_model_len} tokens (at most {most} characters are taken)",
                param,
            )

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise BadRequestError("prompt: empty", "prompt")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise BadRequestError(
                f"prompt: token id {bad[0]} is out of vocabulary (size {self.vocab_size})",
                "prompt",
            )
        if len(ids) >= self.max_model_len:
            raise BadRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt has {len(ids)} tokens.",
                "prompt",
            )
        cache = self.core.cfg.num_blocks * self.core.cfg.block_size
        if len(ids) + 1 > cache:
            raise BadRequestError(
                f"prompt: {len(ids)} tokens do not fit the KV cache ({cache} tokens)", "prompt"
            )

    def sampling(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        prompt_tokens: int,
        *,
        default_max_tokens: int | None,
    ) -> SamplingParams:
        max_tokens = body.max_tokens
        if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
            max_tokens = body.max_completion_tokens
        room = self.max_model_len - prompt_tokens
        if max_tokens is None:
            max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
        if prompt_tokens + max_tokens > self.max_model_len:
            raise BadRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the "
                f"prompt, {max_tokens} in the completion).",
                "max_tokens",
            )
        if max_tokens < 1:
            raise BadRequestError("max_tokens: must be at least 1", "max_tokens")
        if body.min_tokens > max_tokens:
            raise BadRequestError(
                f"min_tokens: must be at most max_tokens ({max_tokens}), got {body.min_tokens}",
                "min_tokens",
            )
        bad = [t for t in body.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise BadRequestError(f"stop_token_ids: {bad[0]} is out of vocabulary", "stop")
        if any(not stop for stop in body.stops()):
            raise BadRequestError("stop: an empty stop string", "stop")
        kv = body.kv_transfer_params
        if kv is not None and kv.do_remote_decode:
            max_tokens = 1  # a prefill for a remote decode samples one token, as vLLM's proxy asks
        if isinstance(body, CompletionRequest):
            logprobs = body.logprobs
        else:
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
        if logprobs is not None and logprobs > MAX_LOGPROBS:
            raise BadRequestError(
                f"logprobs: at most {MAX_LOGPROBS} (vLLM's default max_logprobs)", "logprobs"
            )
        temperature = body.temperature
        if 0.0 < temperature < MIN_TEMPERATURE:
            temperature = MIN_TEMPERATURE  # as vLLM: logits / 1e-300 are inf, and sampling fails
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=body.top_p,
            seed=body.seed,
            stop_token_ids=tuple(body.stop_token_ids),
            stop=body.stops(),
            ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens,
            logprobs=logprobs,
        )

    def model_card(self) -> dict[str, Any]:
        return {
            "id": self.served_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "pearl",
            "root": str(self.model_dir),
            "max_model_len": self.max_model_len,
        }

    # -- pause, resume, weights --------------------------------------------------------

    async def pause(self, mode: str, clear_cache: bool) -> None:
        core = self.core

        def stop_admitting() -> None:
            core.scheduler.admit = False
            if mode == "abort":
                core.abort_all()
            if mode != "wait":
                core.paused = True

        await self.run(stop_admitting)
        if mode == "wait":
            while await self.run(lambda: bool(core.scheduler.running)):
                await asyncio.sleep(0.01)
            await self.run(lambda: setattr(core, "paused", True))
        if clear_cache:
            await self.run(core.reset_prefix_cache)
        self.paused = True

    def resume_now(self) -> None:
        self.core.paused = False
        self.core.scheduler.admit = True
        self.paused = False

    async def reload(self, path: str | None, version: int | None) -> int:
        """Load every weight from ``path`` (default: the model directory) and return the
        new weight version."""
        where = Path(path) if path else self.model_dir
        tensors = await asyncio.to_thread(read_weights, where)
        try:
            loaded = await self.run(lambda: self.core.load_weights(tensors, version))
        except WeightError as err:
            raise BadRequestError(f"weights in {where}: {err}") from None
        if where == self.model_dir:
            self.dir_version = loaded
        return loaded


def _shown(err: Exception, limit_chars: int = 200) -> str:
    """An error's message, cut to ``limit_chars`` (a template may quote its input)."""
    text = str(err)
    return text if len(text) <= limit_chars else text[: limit_chars - 3] + "..."
