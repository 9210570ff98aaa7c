"""SFT data: records (or a task's reference answers) -> token rows with their target mask.

Sources (`make_sources`): sft.train_path / sft.val_path or the API's datasets, read by
`tasks.data.load_table` like GRPO data; unset, the data task's examples and reference answers.
A record is `messages` (chat turns, tool calls and results included) or a `prompt` and a
`completion` (strings or message lists). `Encoder` lays a record out as the rollout does: a
conversation by `rollout.conversation.ChatFormat.encode` with the task's tool schemas (assistant
turns through their end-of-turn token are targets, all else context); a string prompt through
the chat template when the rollout would (data.wraps_string_prompts), else prompt ids ++
completion ids ++ EOS, tokenised apart. Masks are aligned with the tokens they score. Too long,
no target or no prompt: a ConfigError naming the record; record files are encoded up front.
`SFTSource` hands out encoded examples in a restorable order; `make_batch` lays them into a
right-padded numpy `TrainBatch` (rewards 0, a group per row, sample_mask 0 on padding rows)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np

from jgrpo.batch import TrainBatch
from jgrpo.config import Config, ConfigError
from jgrpo.tasks.data import RecordStream, check_records, load_table

Encoded = tuple[list[int], list[int]]
"""(token ids, target mask) of one example."""


def _clean(messages: Any, where: str) -> list[dict]:
    """Messages as plain dicts without None-valued keys (Arrow gives every message every key)."""
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) for m in messages):
        raise ConfigError(f"{where}: expected a list of message dicts (role, content)")
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


class Encoder:
    """Token ids and target masks of records and task examples under one tokenizer."""

    def __init__(self, tokenizer, cfg: Config, tools: Optional[list[dict]] = None):
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.tools = tools or None
        self._chat = None
        self.eos_id = int(tokenizer.eos_token_id)

    def chat(self, where: str):
        """The rollout's ChatFormat (made on first use); ConfigError without a template."""
        if self._chat is None:
            from jgrpo.rollout.conversation import ChatFormat

            if not getattr(self.tokenizer, "chat_template", None):
                raise ConfigError(
                    f"{where}: a chat conversation, but model.path's tokenizer has no chat "
                    "template (give prompt/completion strings, or a model with a template)"
                )
            self._chat = ChatFormat(self.tokenizer, [self.eos_id], self.tools)
        return self._chat

    @property
    def wraps_strings(self) -> bool:
        """A string prompt goes through the chat template, as the rollout renders it."""
        template = getattr(self.tokenizer, "chat_template", None)
        return bool(self.cfg.data.wraps_string_prompts and template)

    def conversation(self, messages: list[dict], where: str) -> Encoded:
        try:
            return self.chat(where).encode(messages)
        except ConfigError:
            raise
        except Exception as e:  # the template's own error, or no prompt / no assistant turn
            raise ConfigError(f"{where}: {str(e).splitlines()[0]}") from None

    def text(self, prompt: str, completion: str, where: str) -> Encoded:
        if self.wraps_strings:
            system = self.cfg.data.system_prompt
            head = [{"role": "system", "content": system}] if system else []
            turns = [
                {"role": "user", "content": prompt},
                {"role": "assistant", "content": completion},
            ]
            return self.conversation(head + turns, where)
        ids = lambda s: list(self.tokenizer(s, add_special_tokens=False)["input_ids"])
        prompt_ids, target = ids(prompt), ids(completion) + [self.eos_id]
        return prompt_ids + target, [0] * len(prompt_ids) + [1] * len(target)

    def record(self, record: dict, where: str) -> Encoded:
        """One dataset record (module docstring); `where` names it in errors."""
        s = self.cfg.sft
        messages = record.get(s.messages_key)
        if messages is not None:
            return self.conversation(_clean(messages, where), where)
        prompt, completion = record.get(s.prompt_key), record.get(s.completion_key)
        if prompt is None or completion is None:
            raise ConfigError(
                f"{where}: has neither {s.messages_key!r} (sft.messages_key) nor both "
                f"{s.prompt_key!r} and {s.completion_key!r} (sft.prompt_key, "
                "sft.completion_key)"
            )
        if isinstance(prompt, str) and isinstance(completion, str):
            return self.text(prompt, completion, where)
        as_list = lambda x, role: [{"role": role, "content": x}] if isinstance(x, str) else x
        messages = _clean(as_list(prompt, "user"), where)
        messages += _clean(as_list(completion, "assistant"), where)
        return self.conversation(messages, where)

    def reference(self, task, example: dict) -> Encoded:
        """A task example and its reference answer, as the rollout would lay them out: the
        task's ideal conversation (tools) or its reference completion."""
        where = f"data.task {task.cfg.task!r}, example {example.get('id')}"
        if task.needs_chat_template:
            if not hasattr(task.kind, "reference_messages"):
                raise ConfigError(f"{where}: no reference conversation to train on")
            messages = task.prompt_messages(example) + task.kind.reference_messages(example)
            return self.conversation(messages, where)
        completion = task.reference_completion(example)
        if self.wraps_strings:
            turn = [{"role": "assistant", "content": completion}]
            return self.conversation(task.prompt_messages(example) + turn, where)
        return self.text(task.format_prompt(example), completion, where)


def check_encoded(encoded: Encoded, max_len: int, where: str) -> Encoded:
    ids, mask = encoded
    if len(ids) > max_len:
        raise ConfigError(
            f"sft.max_seq_length: {where} has {len(ids)} tokens, more than {max_len} (raise "
            "sft.max_seq_length; nothing is truncated)"
        )
    if not any(mask):
        raise ConfigError(f"{where}: no target (assistant) token to train on")
    if mask[0]:
        raise ConfigError(f"{where}: the target starts at the first token (give a prompt)")
    return encoded


@dataclasses.dataclass
class SFTSource:
    """Encoded examples in a restorable order: `stream` (next_prompts / state / restore) of
    raw items and `encode(item) -> Encoded`."""

    stream: Any
    encode: Any
    name: str

    def next_examples(self, n: int) -> list[Encoded]:
        return [self.encode(item) for item in self.stream.next_prompts(n)]

    def state(self) -> dict:
        return self.stream.state()

    def restore(self, state: dict) -> None:
        self.stream.restore(state)


def encode_table(table, encoder: Encoder, max_len: int, key: str) -> list[Encoded]:
    """Every record of `table` encoded and checked (the first bad one named)."""
    out = []
    for i in range(len(table)):
        where = f"{key} record {i}"
        out.append(check_encoded(encoder.record(dict(table[i]), where), max_len, where))
    return out


def _table(dataset, path: Optional[str], key: str, split: str, cfg: Config):
    if dataset is not None:
        check_records(dataset, key)
        return dataset
    if path is None:
        return None
    return load_table(path, key, split, cfg.sft.dataset_config)


def make_sources(
    cfg: Config, encoder: Encoder, task, train_dataset=None, eval_dataset=None
) -> tuple[SFTSource, Optional[list[Encoded]]]:
    """(the training source, the validation examples or None) of cfg.sft (module docstring);
    `train_dataset` / `eval_dataset` (lists of dicts or datasets.Dataset) replace the paths."""
    s = cfg.sft
    max_len = s.max_seq_length
    train_key = "train_dataset" if train_dataset is not None else "sft.train_path"
    train = _table(train_dataset, s.train_path, train_key, "train", cfg)
    val_key = "eval_dataset" if eval_dataset is not None else "sft.val_path"
    val = _table(eval_dataset, s.val_path, val_key, "val", cfg)
    val_examples = None if val is None else encode_table(val, encoder, max_len, val_key)
    if train is not None:
        examples = encode_table(train, encoder, max_len, train_key)
        stream = RecordStream(examples, s.seed, s.shuffle)
        return SFTSource(stream, lambda x: x, train_key), val_examples

    def reference(example: dict) -> Encoded:
        where = f"data.task {task.cfg.task!r} example {example.get('id')}"
        return check_encoded(encoder.reference(task, example), max_len, where)

    if not (hasattr(task.kind, "reference_completion") or task.needs_chat_template):
        raise ConfigError(
            f"sft.train_path: unset, and data.task {task.cfg.task!r} has no reference answers "
            "to train on; give sft.train_path (messages or prompt/completion records)"
        )
    before = task.train.state()
    reference(task.train.next_prompts(1)[0])  # a bad layout named before any model loads
    task.train.restore(before)
    if val_examples is None and task.val:
        val_examples = [reference(ex) for ex in task.val]
    return SFTSource(task.train, reference, f"data.task {task.cfg.task!r}"), val_examples


def make_batch(examples: Sequence[Encoded], rows: int, width: int, pad_id: int) -> TrainBatch:
    """Right-padded numpy TrainBatch of `rows` rows x `width` tokens: input_ids, attention_mask
    (1 on real tokens), token_mask (the targets); rows past the examples are padding
    (sample_mask 0); rewards 0, each row its own group."""
    ids = np.full((rows, width), pad_id, np.int32)
    attention = np.zeros((rows, width), np.float32)
    targets = np.zeros((rows, width), np.float32)
    for i, (row_ids, row_mask) in enumerate(examples):
        ids[i, : len(row_ids)] = row_ids
        attention[i, : len(row_ids)] = 1.0
        targets[i, : len(row_mask)] = row_mask
    sample = (np.arange(rows) < len(examples)).astype(np.float32)
    return TrainBatch(
        input_ids=ids,
        attention_mask=attention,
        token_mask=targets,
        generation_logprobs=np.zeros((rows, width), np.float32),
        rewards=np.zeros(rows, np.float32),
        group_ids=np.arange(rows, dtype=np.int32),
        sample_mask=sample,
    )
