"""Token ids of a conversation from its chat template: the token-in/token-out rule.

A multi-turn rollout is kept as token ids. An assistant turn adds exactly the ids the sampler
generated (its stop token included; loss mask 1). Any other message (tool results, an
environment's observation) adds the ids of the chat template's rendering of it as a SUFFIX of
the conversation (loss mask 0): what the template writes after the assistant's end-of-turn
token (ChatML's "\\n" after <|im_end|>), the message(s), then the next generation prompt
(<|im_start|>assistant\\n). Generated text is never decoded and tokenised back (TRL #5224 /
#5144). suffix = render(history + messages, generation prompt) - render(history) up to its
end-of-turn token, with a fixed stand-in history (user "x", assistant "x": independent of how a
template re-renders earlier turns), tokenised alone: the whole rendering's ids where the
tokenizer splits at the end-of-turn token (ChatML's special tokens make it so; tested).
`ChatFormat(tokenizer, stop_ids, tools)`: `prompt_ids`, `reply_ids`, `assistant_ids` (what a model
emits for a message: SFT targets) and `encode(messages) -> (ids, loss_mask)`, a whole
conversation laid out as a rollout lays it out (warm-start traces use it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

_STAND_IN = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "x"}]


class TemplateError(ValueError):
    """The chat template cannot give turn suffixes (no template, or no end-of-turn token)."""


class ChatFormat:
    """Ids of prompts, replies and assistant turns under one tokenizer's chat template."""

    def __init__(self, tokenizer, stop_ids: Sequence[int], tools: Optional[list[dict]] = None):
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError("the tokenizer has no chat template")
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.stop_texts = [tokenizer.decode([int(i)]) for i in stop_ids]
        history = self.render(_STAND_IN)
        self._history = history[: self._end_of_turn(history, history.rfind("x") + 1)]
        self._prompt_end = len(self.render(_STAND_IN[:1], generation_prompt=True))

    def render(self, messages: list[dict], generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools, add_generation_prompt=generation_prompt, tokenize=False
        )

    def ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _end_of_turn(self, text: str, after: int) -> int:
        """The end of the first stop token's text at or after position `after` of `text`."""
        found = [(text.find(s, after), s) for s in self.stop_texts if s and s in text[after:]]
        if not found:
            raise TemplateError(
                f"the chat template ends an assistant turn with none of the stop tokens "
                f"{self.stop_texts}"
            )
        at, stop = min(found)
        return at + len(stop)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The conversation so far (ending in a user or tool message) + the generation prompt."""
        return self.ids(self.render(messages, generation_prompt=True))

    def reply_ids(self, messages: list[dict]) -> list[int]:
        """The ids appended after an assistant turn's stop token when `messages` (tool results,
        an observation; [] = none) answer it: template suffix, then the generation prompt."""
        full = self.render(_STAND_IN + list(messages), generation_prompt=True)
        if not full.startswith(self._history):
            raise TemplateError("the chat template re-renders earlier turns when one is added")
        return self.ids(full[len(self._history) :])

    def assistant_ids(self, message: dict) -> list[int]:
        """The ids a model trained on this template generates for assistant `message` (tool
        calls rendered as the template writes them), through its end-of-turn (stop) token."""
        full = self.render([*_STAND_IN[:1], message])
        start = self._prompt_end
        return self.ids(full[start : self._end_of_turn(full, start)])

    def encode(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        """(ids, loss_mask) of a conversation laid out as a rollout: the prompt (every message
        before the first assistant one) with the generation prompt, then each assistant message
        (`assistant_ids`, mask 1) and each run of other messages (`reply_ids`, mask 0)."""
        first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
        if first is None or first == 0:
            raise ValueError("encode: needs prompt messages, then an assistant message")
        ids = self.prompt_ids(messages[:first])
        mask = [0] * len(ids)
        i = first
        while i < len(messages):
            if messages[i]["role"] == "assistant":
                part, bit, i = self.assistant_ids(messages[i]), 1, i + 1
            else:
                j = next(
                    (k for k in range(i, len(messages)) if messages[k]["role"] == "assistant"),
                    len(messages),
                )
                part, bit, i = self.reply_ids(messages[i:j]), 0, j
            ids += part
            mask += [bit] * len(part)
        return ids, mask


def tool_message(name: str, content: str) -> dict[str, Any]:
    """A tool's result as a chat message."""
    return {"role": "tool", "name": name, "content": content}
