r"""The tool-aware ChatML chat template of `builtin:tiny-qwen2-chat` (a jinja string).

Qwen2.5's structure, written from its known layout: `<|im_start|>{role}\n{content}<|im_end|>\n`
per message; an assistant message's `tool_calls` as `\n<tool_call>\n{"name": ..., "arguments":
{...}}\n</tool_call>` after its content (the hermes format, `jgrpo.rollout.tool_calls`); a run
of `tool` messages as ONE user turn holding `\n<tool_response>\n{content}\n</tool_response>` per
message; `add_generation_prompt` writes `<|im_start|>assistant\n`. Deviations, for a char-level
model that pays one position per byte: no default system message (Qwen2.5 writes "You are
Qwen..."), and `tools=` are listed one line each, `name(arg, ...): description`, instead of their
whole JSON schema; the system turn exists only when there is a system message or tools.
"""

from __future__ import annotations

TOOL_CHAT_TEMPLATE = r"""
{%- set system = messages[0].content if messages and messages[0].role == 'system' else none %}
{%- if system is not none or tools %}
    {{- '<|im_start|>system\n' }}
    {%- if system is not none %}
        {{- system }}
    {%- endif %}
    {%- if tools %}
        {%- if system is not none %}
            {{- '\n' }}
        {%- endif %}
        {{- '# Tools' }}
        {%- for tool in tools %}
            {%- set f = tool.function if tool.function is defined else tool %}
            {%- set props = f.parameters.properties if f.parameters is defined else {} %}
            {{- '\n' + f.name + '(' + props.keys() | list | join(', ') + ')' }}
            {%- if f.description %}
                {{- ': ' + f.description }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'assistant' and not message.tool_calls %}
        {{- '<|im_start|>assistant\n' + (message.content or '') + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for call in message.tool_calls %}
            {%- set call = call.function if call.function is defined else call %}
            {{- '\n<tool_call>\n{"name": "' + call.name + '", "arguments": ' }}
            {{- call.arguments if call.arguments is string else call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""
"""The jinja source (HF `apply_chat_template` renders it with messages, tools and
add_generation_prompt)."""
