"""Tool-call formats: an assistant turn's text -> its content and the tool calls it makes.

`parse_tool_calls(text, fmt)` dispatches on `rollout.tool_call_format` through `FORMATS`, the
one place a format is named. `hermes` (Qwen2.5 / Qwen3, NousResearch's Hermes): each call is
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (whitespace around the JSON allowed),
the content is the text before the first `<tool_call>`, stripped. A block that is not a JSON
object with a string `name` and an object `arguments` (a JSON string holding one is accepted)
stays in its place as an error string: `ParsedTurn.blocks` holds every block in the order of
the text, a ToolCall or an error, and the turn loop answers block i with tool message i (an
error message for a malformed block, as for a failing call). To add a format: write
`parse_<name>(text) -> ParsedTurn`, add it to
`FORMATS` and its name to the `RolloutConfig.tool_call_format` Literal.
The text parsed is the decoded generated ids; it is never tokenised back (the conversation keeps
the generated ids themselves: jgrpo.rollout.conversation).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call: the tool's name and its keyword arguments."""

    name: str
    arguments: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
    """An assistant turn as a chat message would hold it."""

    content: str
    """The text outside the tool calls (before the first one)."""
    blocks: tuple[ToolCall | str, ...] = ()
    """Every call block in the order of the text: its ToolCall, or for a malformed block the
    error message that answers it (in its place: answer i goes with block i)."""

    @property
    def calls(self) -> tuple[ToolCall, ...]:
        """The well-formed calls, in order."""
        return tuple(b for b in self.blocks if isinstance(b, ToolCall))

    @property
    def errors(self) -> tuple[str, ...]:
        """The error messages of the malformed blocks, in order."""
        return tuple(b for b in self.blocks if isinstance(b, str))

    def message(self) -> dict:
        """The assistant message in transformers' chat format (`tool_calls` only when there are
        calls): what reward functions receive and chat templates render."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.calls:
            out["tool_calls"] = [
                {"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.calls
            ]
        return out


_HERMES_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> ParsedTurn:
    """`<tool_call>{json}</tool_call>` blocks (an unclosed last block is parsed too)."""
    start = text.find("<tool_call>")
    if start < 0:
        return ParsedTurn(content=text.strip())
    blocks = tuple(_json_call(m.group(1)) for m in _HERMES_RE.finditer(text, start))
    return ParsedTurn(content=text[:start].strip(), blocks=blocks)


def _json_call(body: str) -> ToolCall | str:
    """The call of one block, or the error message answering it."""
    try:
        value = json.loads(body)
    except ValueError as e:
        return f"error: the tool call is not valid JSON ({e.msg} at char {e.pos})"
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return 'error: a tool call must be {"name": ..., "arguments": {...}}'
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    if not isinstance(arguments, dict):
        return f"error: the arguments of {value['name']!r} must be a JSON object"
    return ToolCall(value["name"], arguments)


FORMATS = {"hermes": parse_hermes}
"""rollout.tool_call_format -> its parser (the only place formats are dispatched)."""


def parse_tool_calls(text: str, fmt: str) -> ParsedTurn:
    """The content and calls of one assistant turn's text in format `fmt`."""
    return FORMATS[fmt](text)
