"""The general prompt task (`data.task: prompts`): your dataset, your rewards.

Each record's `data.prompt_key` column (default `prompt`) holds either a string or a list of
chat messages `[{"role": ..., "content": ...}, ...]`; every other column is kept and reaches
the reward functions as a keyword argument (a list aligned with the rows, as in TRL).

Prompt text: a message list goes through the tokenizer's chat template (with
`add_generation_prompt=True`; data.system_prompt is put first unless the list starts with a
system message); a string is used verbatim (TRL's convention) unless data.use_chat_template
is true and the tokenizer has a template, then it is wrapped as one user message. There is no
built-in verifier (so no accuracy metric): the reward is data.reward_functions alone.

What a reward function sees for row b (TRL's conventions): `prompts[b]` is the record's prompt
value as stored (string or messages), `completions[b]` the generated text, or
`[{"role": "assistant", "content": text}]` when the prompt is a message list.
"""

from __future__ import annotations

from typing import Any, Optional

from jgrpo.config import ConfigError, DataConfig
from jgrpo.tasks.data import Example, Table, column_names, first_null


def _messages_problem(value: Any) -> Optional[str]:
    """Why `value` is not a usable prompt (None when it is a string or a message list)."""
    if isinstance(value, str):
        return None
    if not isinstance(value, (list, tuple)) or not value:
        return f"is {type(value).__name__} {str(value)[:40]!r}, not a string or a message list"
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return f"has a message without a string 'role': {str(m)[:60]!r}"
        if not isinstance(m.get("content"), (str, list)):
            return f"has a message without 'content': {str(m)[:60]!r}"
    return None


class PromptsTask:
    """Prompts from a dataset column; no verifier, no reference completion, no generator."""

    name = "prompts"
    space_size = None
    has_verifier = False

    def __init__(self, cfg: DataConfig):
        self.key = cfg.prompt_key
        self.has_messages = False
        """Some checked record's prompt is a message list (the tokenizer needs a template)."""

    def check_table(self, table: Table, where: str) -> None:
        """ConfigError naming the record when the prompt column is absent, null or malformed.

        Nulls are found with Arrow null counts; the values are checked one by one only for
        Python lists and for `Json` columns (a file mixing plain and chat prompts)."""
        names = column_names(table)
        if self.key not in names:
            raise ConfigError(
                f"data.prompt_key: {where} has no column {self.key!r} "
                f"(columns: {', '.join(map(str, names))})"
            )
        bad = first_null(table, self.key)
        if bad is not None:
            raise ConfigError(f"data.prompt_key: record {bad} of {where} has a null {self.key!r}")
        if hasattr(table, "features"):
            feature = table.features[self.key]
            kind = type(feature).__name__
            if kind == "Value" and getattr(feature, "dtype", "") in ("string", "large_string"):
                return  # plain strings, none null
            if kind not in ("Json", "List", "Sequence", "LargeList"):
                raise ConfigError(
                    f"data.prompt_key: column {self.key!r} of {where} holds {feature}; expected "
                    "strings or lists of {role, content} messages"
                )
            batches = table.select_columns([self.key]).iter(batch_size=1024)
            values = (v for batch in batches for v in batch[self.key])
        else:
            values = (record[self.key] for record in table)
        for i, value in enumerate(values):
            self.has_messages |= not isinstance(value, str)
            problem = _messages_problem(value)
            if problem is not None:
                raise ConfigError(f"data.prompt_key: record {i} of {where}: {self.key!r} {problem}")

    def example_from_record(self, record: dict, index: int, where: str, cfg: DataConfig):
        value = record.get(self.key)
        if value is None:
            raise ConfigError(f"data.prompt_key: record {index} of {where} has a null {self.key!r}")
        return {"task": self.name, "row": record}

    # prompts (see jgrpo.tasks.task.Task.format_prompt)

    def prompt_value(self, example: Example) -> Any:
        return example["row"][self.key]

    def bare_prompt(self, example: Example) -> Optional[str]:
        """The string prompt verbatim, or None for a message list (it needs a chat template)."""
        value = self.prompt_value(example)
        return value if isinstance(value, str) else None

    def messages(self, example: Example) -> list[dict]:
        value = self.prompt_value(example)
        return [{"role": "user", "content": value}] if isinstance(value, str) else list(value)

    def reference_completion(self, example: Example) -> str:
        raise ValueError("task 'prompts' has no reference completions (no SFT target)")

    # rewards

    def reward_record(self, example: Example) -> dict:
        """The columns a reward function gets for this row: all but the prompt."""
        return {k: v for k, v in example["row"].items() if k != self.key}

    def reward_inputs(self, example: Example, prompt_text: str, completion: str):
        """(prompt, completion) as TRL passes them: the stored prompt; chat completions for
        message prompts."""
        value = self.prompt_value(example)
        if isinstance(value, str):
            return value, completion
        return value, [{"role": "assistant", "content": completion}]
