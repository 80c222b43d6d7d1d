"""The ChatML chat template of ``pearl model init``'s tiny models, in Qwen's shape.

Roles system, user, assistant and tool. Tools go in the system turn with the instruction to
call them as ``<tool_call>`` JSON; an assistant's ``tool_calls`` are rendered as such blocks
and tool results as ``<tool_response>`` blocks in a user turn, consecutive ones together.
``add_generation_prompt`` opens an assistant turn; ``enable_thinking=false`` gives it an
empty ``<think>`` block, as Qwen3 does. Rendered with trimmed blocks (transformers' and
:mod:`pearl.engines.reference.tokenizer`'s environment).
"""

from __future__ import annotations

CHATML_TEMPLATE = """\
{%- if messages and messages[0].role == 'system' -%}
{%- set system_text = messages[0].content -%}
{%- else -%}
{%- set system_text = none -%}
{%- endif -%}
{%- if tools -%}
<|im_start|>system
{% if system_text %}
{{ system_text }}

{% endif %}
# Tools

These functions are available; their signatures, one JSON object per line, are inside \
<tools></tools>:
<tools>
{% for tool in tools %}
{{ tool | tojson }}
{% endfor %}
</tools>

To call functions, answer with one JSON object per call, each inside \
<tool_call></tool_call> tags:
<tool_call>
{"name": "<function name>", "arguments": <JSON object of arguments>}
</tool_call><|im_end|>
{% elif system_text is not none %}
<|im_start|>system
{{ system_text }}<|im_end|>
{% endif %}
{% for message in messages %}
{% if message.role == 'system' %}
{% if not loop.first %}
{{ raise_exception('only the first message can be a system message') }}
{% endif %}
{% elif message.role == 'user' %}
<|im_start|>user
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}
<|im_start|>assistant
{% if message.content %}
{{ message.content }}
{%- endif %}
{% for call in message.tool_calls or [] %}
{% set function = call.function if call.function is defined else call %}
{% if message.content or not loop.first %}

{% endif %}
<tool_call>
{"name": "{{ function.name }}", "arguments": \
{{ function.arguments if function.arguments is string else function.arguments | tojson }}}
</tool_call>
{%- endfor %}
<|im_end|>
{% elif message.role == 'tool' %}
{% if loop.first or loop.previtem.role != 'tool' %}
<|im_start|>user
{% else %}

{% endif %}
<tool_response>
{{ message.content }}
</tool_response>
{%- if loop.last or loop.nextitem.role != 'tool' %}
<|im_end|>
{% endif %}
{% else %}
{{ raise_exception('unknown role: ' ~ message.role) }}
{% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}
<think>

</think>

{% endif %}
{% endif %}
"""
