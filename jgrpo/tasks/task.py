"""`make_task(data_cfg, seed)`: the one object the trainer and rollout workers use for data.

A Task owns the training order (`task.train`, a restorable stream), the held-out examples
(`task.val`), prompt text (`format_prompt`), the SFT target (`reference_completion`) and the
reward (`score`). The task kinds (arithmetic, countdown, gsm8k) are dispatched in one place,
`_KINDS`; they differ only in prompts, references, generation and verifier.

Validation set: data.val_path when given (its first data.num_val_examples records); else, for
file data, a seeded split of train_path disjoint from training (at most half of the records);
else a synthetic set disjoint from every training example (same dedup key: the question for
arithmetic, the number multiset for countdown). The split and the synthetic val set depend only
on the data config, not on the run seed, so runs with different seeds are validated alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from jgrpo.config import ConfigError, DataConfig
from jgrpo.tasks.arithmetic import ArithmeticTask
from jgrpo.tasks.countdown import CountdownTask
from jgrpo.tasks.data import (
    Example,
    RecordStream,
    SyntheticStream,
    read_records,
    split_indices,
)
from jgrpo.tasks.gsm8k import GSM8KTask
from jgrpo.tasks.rewards import ERROR, TIMEOUT, RewardRunner, import_reward_function

_KINDS = {"arithmetic": ArithmeticTask, "countdown": CountdownTask, "gsm8k": GSM8KTask}
_VAL_SEED = 20_240_601
"""Seed of synthetic validation sets (fixed: the same for every run seed)."""
_MAX_REJECTS = 10_000


class Task:
    """Data, prompts and rewards of one run; build it with `make_task`.

    Pickling keeps only (data_cfg, seed): the copy is rebuilt with `load_data=False`, so a Ray
    worker can format prompts and score without the data files; the data order stays with the
    trainer's Task.
    """

    def __init__(self, cfg: DataConfig, seed: int, load_data: bool = True):
        if cfg.task not in _KINDS:
            raise ConfigError(
                f"data.task: {cfg.task!r} is not allowed; choose one of "
                f"{', '.join(map(repr, _KINDS))}"
            )
        self.cfg = cfg
        self.seed = int(seed)
        self.kind = _KINDS[cfg.task](cfg)
        for i, rf in enumerate(cfg.reward_functions):
            import_reward_function(rf.function, f"data.reward_functions[{i}].function")
        self._runner = RewardRunner(
            [rf.function for rf in cfg.reward_functions], cfg.reward_timeout_s
        )
        self._train = self._val = None
        if load_data:
            self._train, self._val = self._build_data()

    def __reduce__(self):
        return (Task, (self.cfg, self.seed, False))

    # ------------------------------------------------------------------------- data

    @property
    def train(self) -> RecordStream | SyntheticStream:
        """Training order: `next_prompts(n) -> list[Example]`, `state()`, `restore(state)`."""
        if self._train is None:
            raise RuntimeError(
                "this Task was built without data (load_data=False or unpickled); "
                "use make_task(data_cfg, seed) in the trainer"
            )
        return self._train

    @property
    def val(self) -> list[Example]:
        """The fixed held-out examples (data.num_val_examples of them, or fewer if capped)."""
        if self._val is None:
            raise RuntimeError("this Task was built without data (load_data=False or unpickled)")
        return self._val

    def _build_data(self):
        cfg = self.cfg
        if cfg.train_path is None:
            if cfg.task == "gsm8k":
                raise ConfigError(
                    "data.train_path: task 'gsm8k' needs a JSONL / Parquet file or "
                    "HF datasets folder of question/answer records"
                )
            if cfg.val_path is not None:
                val = self._read_examples(cfg.val_path, "data.val_path", "val")
                val = val[: cfg.num_val_examples]
                return SyntheticStream(self._make_generator(set()), self.seed), val
            val, keys = self._synthetic_val()
            return SyntheticStream(self._make_generator(keys), self.seed), val
        train = self._read_examples(cfg.train_path, "data.train_path", "train")
        if cfg.val_path is not None:
            val = self._read_examples(cfg.val_path, "data.val_path", "val")
            val = val[: cfg.num_val_examples]
        else:
            if len(train) < 2:
                raise ConfigError(
                    f"data.train_path: {cfg.train_path!r} has {len(train)} record; "
                    "need >= 2 to hold out a validation split (or set data.val_path)"
                )
            train_idx, val_idx = split_indices(len(train), cfg.num_val_examples)
            train, val = [train[i] for i in train_idx], [train[i] for i in val_idx]
        return RecordStream(train, self.seed, cfg.shuffle), val

    def _read_examples(self, path: str, key: str, split: str) -> list[Example]:
        records = read_records(path, key, split)
        where = f"{key} {path!r}"
        examples = []
        for i, record in enumerate(records):
            example = self.kind.example_from_record(record, i, where, self.cfg)
            example["id"] = f"{split}/{i}"
            examples.append(example)
        return examples

    def _synthetic_val(self) -> tuple[list[Example], set]:
        num_val = min(self.cfg.num_val_examples, self.kind.space_size // 2)
        val, keys = [], set()
        rng = np.random.default_rng(_VAL_SEED)
        for _ in range(50 * num_val + 1000):
            if len(val) == num_val:
                break
            key, example = self.kind.generate(rng)
            if key not in keys:
                keys.add(key)
                example["id"] = f"val/{len(val)}"
                val.append(example)
        return val, keys

    def _make_generator(self, exclude: set):
        kind = self.kind

        def generate(rng: np.random.Generator, index: int) -> Example:
            for _ in range(_MAX_REJECTS):
                key, example = kind.generate(rng)
                if key not in exclude:
                    example["id"] = f"train/{index}"
                    return example
            raise RuntimeError(
                f"no training example outside the validation set after {_MAX_REJECTS} draws"
            )

        return generate

    # ------------------------------------------------------------------------- prompts

    def format_prompt(self, example: Example, tokenizer: Any = None) -> str:
        """Prompt text: the chat template when data.use_chat_template and the tokenizer has one
        (encode it with add_special_tokens=False), else the task's bare compact prompt."""
        template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
        if not (self.cfg.use_chat_template and template):
            return self.kind.bare_prompt(example)
        user = self.kind.instruction(example)
        messages = [{"role": "user", "content": user}]
        if self.cfg.system_prompt:
            messages.insert(0, {"role": "system", "content": self.cfg.system_prompt})
        try:
            return tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
        except Exception:  # noqa: BLE001 - templates without a system role (e.g. Gemma)
            if not self.cfg.system_prompt:
                raise
            merged = [{"role": "user", "content": f"{self.cfg.system_prompt}\n\n{user}"}]
            return tokenizer.apply_chat_template(merged, add_generation_prompt=True, tokenize=False)

    def reference_completion(self, example: Example) -> str:
        """The ideal completion in the bare format, without EOS (the SFT warm-start target);
        the verifier scores it correct under chat prompts too."""
        return self.kind.reference_completion(example)

    # ------------------------------------------------------------------------- rewards

    def verify(self, completion: str, example: Example) -> bool:
        """The task verifier alone: is the completion's final answer correct?"""
        return bool(self.kind.verify(completion, example))

    def score(
        self, prompts: Sequence[str], completions: Sequence[str], examples: Sequence[Example]
    ) -> tuple[np.ndarray, dict]:
        """Rewards float32[N] = task_reward_weight * correct + sum_i weight_i * fn_i(...).

        info: accuracy (fraction the verifier marked correct), num_reward_errors,
        num_reward_timeouts (custom-function samples that raised / ran out of time; they score
        0), correct bool[N], custom_rewards float32[F, N] (unweighted; 0 where failed).
        """
        n = len(completions)
        if not len(prompts) == len(examples) == n:
            raise ValueError(
                f"score: {len(prompts)} prompts, {n} completions, {len(examples)} examples"
            )
        correct = np.zeros(n, bool)
        num_errors = 0
        for j, (completion, example) in enumerate(zip(completions, examples)):
            try:
                correct[j] = self.kind.verify(completion, example)
            except Exception:  # noqa: BLE001 - a malformed example must not stop the run
                num_errors += 1
        rewards = self.cfg.task_reward_weight * correct.astype(np.float64)
        values, status = self._runner.run(prompts, completions, examples)
        for f, rf in enumerate(self.cfg.reward_functions):
            rewards += rf.weight * values[f]
        info = {
            "accuracy": float(correct.mean()) if n else 0.0,
            "num_reward_errors": num_errors + int((status == ERROR).sum()),
            "num_reward_timeouts": int((status == TIMEOUT).sum()),
            "correct": correct,
            "custom_rewards": values.astype(np.float32),
        }
        return rewards.astype(np.float32), info

    def close(self) -> None:
        """Stop the reward child process, if any (it also dies with this process)."""
        self._runner.close()


def make_task(data_cfg: DataConfig, seed: int, *, load_data: bool = True) -> Task:
    """Validate `data_cfg` cheaply (files, fields, reward imports) and build the Task.

    Raises ConfigError (one line naming the dotted key or file) before any model loads.
    `load_data=False` skips reading data (rollout workers that only format and score).
    """
    return Task(data_cfg, seed, load_data=load_data)
