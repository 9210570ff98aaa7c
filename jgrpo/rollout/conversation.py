"""Token ids of a conversation from its chat template: the token-in/token-out rule.

A multi-turn rollout is kept as token ids. An assistant turn adds exactly the ids the sampler
generated (its stop token included; mask 1). Any other message (tool results, an observation)
adds the ids of the template's rendering of it as a SUFFIX of the conversation (mask 0): what
the template writes after the assistant's end-of-turn token (ChatML's "\\n" after <|im_end|>),
the message(s), then the generation prompt. Generated text is never decoded and tokenised back
(TRL #5224 / #5144). suffix = render(history + messages, generation prompt) - render(history)
up to its end-of-turn token, with a fixed stand-in history (user "x", assistant "x"), tokenised
alone: the whole rendering's ids where the tokenizer splits at the end-of-turn token (tested).
`ChatFormat(tokenizer, stop_ids, tools)`: `prompt_ids`, `reply_ids`, `assistant_ids` (SFT
targets), `encode(messages) -> (ids, loss_mask)` and `stop_ids`: the given ones plus the first
special token after an assistant turn's content (a Qwen2.5 base model's EOS is <|endoftext|>,
its turns end with <|im_end|>), where a turn stops. `check_turn_template(folder)`: the
pre-flight of all this (one-line ConfigError)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
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
        history = self.render(_STAND_IN)
        content_end = history.rfind("x") + 1
        special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
        turn_end = [i for i in self.ids(history[content_end:]) if i in special][:1]
        self.stop_ids = tuple(dict.fromkeys([*map(int, stop_ids), *turn_end]))
        """The sampler's stop ids of a turn: the given ones and the template's end of turn."""
        self.stop_texts = [tokenizer.decode([i]) for i in self.stop_ids]
        self._history = history[: self._end_of_turn(history, content_end)]
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
                f"{self.stop_texts} and with no special token"
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


def check_turn_template(folder) -> None:
    """Pre-flight of a multi-turn run's HF `folder` (before any model loads): its tokenizer
    has a chat template that ends an assistant turn with a stop token (its EOS, config.json's
    eos_token_id, or the special token the template ends a turn with) and gives reply ids."""
    import transformers

    from jgrpo.config import ConfigError

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    eos = json.loads((Path(folder) / "config.json").read_text()).get("eos_token_id")
    stops = [tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])]
    try:
        chat = ChatFormat(tokenizer, [i for i in stops if i is not None])
        chat.reply_ids([tool_message("f", "1")])
    except Exception as e:  # TemplateError, or the template's own (jinja) error
        raise ConfigError(
            f"model.path: {str(folder)!r}: multi-turn rollouts (rollout.max_turns > 1, "
            f"data.tools, data.environment) cannot use its chat template: {str(e).splitlines()[0]} "
            "(give the folder a chat template whose assistant turns end with a special token, "
            "or set rollout.max_turns: 1 without tools or an environment)"
        ) from None


def tool_message(name: str, content: str) -> dict[str, Any]:
    """A tool's result as a chat message."""
    return {"role": "tool", "name": name, "content": content}
