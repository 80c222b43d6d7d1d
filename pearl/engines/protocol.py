"""vLLM's HTTP protocol as pearl speaks it: request bodies, response bodies, errors.

Pure (no I/O): pydantic models of the request bodies of ``/v1/completions`` and
``/v1/chat/completions`` with the fields vLLM takes that pearl uses (OpenAI's, plus vLLM's
``stop_token_ids``, ``ignore_eos``, ``min_tokens``, ``return_tokens_as_token_ids``,
``return_token_ids``, ``kv_transfer_params``), and the functions that build the response
bodies and error bodies as vLLM returns them. Unknown fields are accepted and ignored, as
vLLM does. One field is pearl's own: each choice carries ``weight_versions``, the weight
version that generated each of its tokens (AReaL's ``output_versions``), so that a
trajectory interrupted by a weight update knows which tokens are stale.

Errors: vLLM answers a bad request with status 400 and
``{"error": {"message", "type": "BadRequestError", "param", "code": 400}}``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class KVTransferParams(BaseModel):
    """``kv_transfer_params`` of vLLM's disaggregated prefill (NixlConnector)."""

    model_config = ConfigDict(extra="allow")
    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    remote_block_ids: list[int] | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    tp_size: int | None = None

    def pulls(self) -> bool:
        """A decode whose prompt's KV is to be pulled: vLLM does the transfer only when
        every one of these is given."""
        return self.do_remote_prefill and None not in (
            self.remote_engine_id,
            self.remote_request_id,
            self.remote_block_ids,
            self.remote_host,
            self.remote_port,
        )


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    kv_transfer_params: KVTransferParams | None = None
    return_token_ids: bool = False

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("n > 1 is not supported (send one request per sample)")
        return n

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    return_tokens_as_token_ids: bool = False

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("echo is not supported")
        return echo


class ChatCompletionRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    add_generation_prompt: bool = True
    return_tokens_as_token_ids: bool = False


def error_body(message: str, *, status: int = 400, param: str | None = None) -> dict[str, Any]:
    kind = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}
    return {
        "error": {
            "message": message,
            "type": kind.get(status, "InternalServerError"),
            "param": param,
            "code": status,
        }
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


FinishReason = Literal["stop", "length", "abort", "tool_calls"] | None
