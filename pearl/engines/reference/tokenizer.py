"""A model directory's tokenizer: ``tokenizer.json`` through the ``tokenizers`` library, and
``tokenizer_config.json``'s special tokens and chat template, rendered as transformers
renders it (a sandboxed Jinja environment, trimmed blocks, ``tojson`` and
``raise_exception``), so a real model directory's template gives the same prompt.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pearl.io.documents import InputError, read_object

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where transformers 5 saves the template


class ChatTemplateError(ValueError):
    """The template refused the conversation (its ``raise_exception``) or failed on it: a
    problem with the request, not with the model directory."""


class Tokenizer:
    """Text to token ids and back, and conversations to prompts, for one model."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        config: dict[str, Any],
        chat_template: str | None,
        source: str = "<tokenizer>",
    ) -> None:
        self.backend, self.config, self.source = backend, config, source
        self.chat_template = chat_template
        self.eos_token = _token_content(config.get("eos_token"))
        self.bos_token = _token_content(config.get("bos_token"))
        self.pad_token = _token_content(config.get("pad_token"))
        self.eos_token_id = self._id_of(self.eos_token, "eos_token")
        self.bos_token_id = self._id_of(self.bos_token, "bos_token")
        self.pad_token_id = self._id_of(self.pad_token, "pad_token")
        self._template = None if chat_template is None else _compile(chat_template, source)

    @property
    def vocab_size(self) -> int:
        """The number of ids, the added tokens included (transformers' ``len(tokenizer)``)."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    @property
    def special_token_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``; added tokens written in it are recognised, none is added."""
        return list(self.backend.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_text(self, token_id: int) -> str:
        """One token decoded alone, special or not (a logprob's ``token``); a token holding
        part of a UTF-8 character decodes to U+FFFD, as in vLLM."""
        return self.decode([token_id], skip_special_tokens=False)

    def token_id(self, token: str) -> int | None:
        """The id of a token by its vocabulary string, or None."""
        found = self.backend.token_to_id(token)
        return None if found is None else int(found)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The prompt for ``messages`` (OpenAI chat format) by the directory's template;
        extra keyword arguments are template variables (Qwen3's ``enable_thinking``)."""
        if self._template is None:
            raise InputError(self.source, "chat_template", "the tokenizer has no chat template")
        try:
            return self._template.render(
                **template_kwargs,
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                pad_token=self.pad_token or "",
            )
        except jinja2.TemplateError as err:
            raise ChatTemplateError(str(err)) from None

    def _id_of(self, token: str | None, field: str) -> int | None:
        if token is None:
            return None
        found = self.token_id(token)
        if found is None:
            raise InputError(self.source, field, f"{token!r} is not in {TOKENIZER_FILE}")
        return found


def load(model_dir: str | Path) -> Tokenizer:
    """The tokenizer of a Hugging Face model directory: ``tokenizer.json``,
    ``tokenizer_config.json`` and the chat template (``chat_template.jinja`` when present,
    else the config's ``chat_template``)."""
    folder = Path(model_dir)
    path = folder / TOKENIZER_FILE
    if not path.is_file():
        raise InputError(str(path), "", "no such file")
    try:
        backend = tokenizers.Tokenizer.from_file(str(path))
    except Exception as err:  # the library raises plain Exceptions
        raise InputError(str(path), "", f"not a tokenizers file ({err})") from None
    config_path = folder / TOKENIZER_CONFIG_FILE
    config = read_object(config_path)
    template_path = folder / CHAT_TEMPLATE_FILE
    if template_path.is_file():
        template: str | None = template_path.read_text(encoding="utf-8")
    else:
        template = _template_of(config.get("chat_template"), config_path)
    return Tokenizer(backend, config, template, source=str(config_path))


def _template_of(value: Any, path: Path) -> str | None:
    """A template string, or the one named ``default`` of a list of named templates."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        default = named.get("default")
        if isinstance(default, str):
            return default
    raise InputError(str(path), "chat_template", "must be a string or name a 'default' one")


def _token_content(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string or ``{content}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """JSON as chat templates expect it: not HTML-escaped (unlike Jinja's own ``tojson``)."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _GenerationBlocks(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``, which some templates wrap around the
    assistant's text (transformers uses it for assistant masks): rendered as its body."""

    tags = {"generation"}  # noqa: RUF012 (jinja2.ext.Extension declares it a set)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _compile(template: str, source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols", _GenerationBlocks],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as err:
        raise InputError(source, "chat_template", f"line {err.lineno}: {err.message}") from None
