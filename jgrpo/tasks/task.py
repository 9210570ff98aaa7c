"""`make_task(data_cfg, seed)`: the one object the trainer and rollout workers use for data.

A Task owns the training order (`task.train`, a restorable stream), the held-out examples
(`task.val`), prompt text (`format_prompt`), the SFT target (`reference_completion`) and the
reward (`score`). Every task is the same mechanism: records (a dataset, or a generator for the
synthetic tasks) + a prompt per record + reward terms. The kinds, dispatched in one place
(`_KINDS`), differ only in prompts, references, generation and verifier: arithmetic, countdown
and gsm8k have a built-in verifier (weighted by data.task_reward_weight); `prompts` takes the
prompt from a dataset column and is scored by data.reward_functions alone.
Validation set (depends only on the data config): data.val_path (or eval_dataset), its first
data.num_val_examples records; else, record data: round(f x records) held out by a seeded split
of data.val_fraction f, none if unset (no training record turns validation unasked; 1 record
trains); else a synthetic set disjoint from every training example (dedup key: the question
for arithmetic, the number multiset for countdown), at most half the distinct questions.
Each data.val_sets entry is a val-only Task (`task.val_tasks[name]`) with its own scoring."""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np

from jgrpo.config import Config, ConfigError, DataConfig
from jgrpo.tasks.agents import AgentRunner
from jgrpo.tasks.arithmetic import ArithmeticTask
from jgrpo.tasks.calculator import CalculatorTask
from jgrpo.tasks.child import Failure
from jgrpo.tasks.countdown import CountdownTask
from jgrpo.tasks.data import (
    Example,
    RecordStream,
    Rows,
    SyntheticStream,
    Table,
    check_records,
    load_table,
    split_indices,
)
from jgrpo.tasks.gsm8k import GSM8KTask
from jgrpo.tasks.prompts import PromptsTask
from jgrpo.tasks.rewards import ERROR, NONE, OK, TIMEOUT, RewardRunner
from jgrpo.tasks.tools import ToolRunner
from jgrpo.tasks.verifiers_env import describe, env_id, episode

_KINDS = {
    "arithmetic": ArithmeticTask,
    "calculator": CalculatorTask,
    "countdown": CountdownTask,
    "gsm8k": GSM8KTask,
    "prompts": PromptsTask,
}
_NEEDS_RECORDS = ("gsm8k", "prompts")
ENVIRONMENT_TERM = "environment"
"""The reward term (weight 1) of the environment's step rewards, summed over a rollout."""
AGENT_TERM = "agent"
"""The reward term (weight 1) of the rewards data.agent returns (jgrpo.tasks.agents)."""
_VAL_SEED = 20_240_601
"""Seed of synthetic validation sets (fixed: the same for every run seed)."""
_MAX_REJECTS = 10_000


def has_reward(cfg: DataConfig) -> bool:
    """Some reward term scores rows: a built-in verifier weighted != 0, data.reward_functions,
    a data.environment or a data.agent (without any, only a distillation teacher trains)."""
    verifier = getattr(_KINDS.get(cfg.task), "has_verifier", True)
    return bool(
        (verifier and cfg.task_reward_weight != 0)
        or cfg.reward_functions
        or cfg.environment is not None
        or cfg.agent
    )


def check_rewards_given(cfg: DataConfig, distilled: bool = False) -> None:
    """A task without a verifier needs a reward function, unless `distilled` (a
    distillation.teacher grades every token: pure distillation). The Python API adds its
    reward_funcs to data.reward_functions first, so this is not a `validate` rule."""
    verifier = getattr(_KINDS.get(cfg.task), "has_verifier", True)
    if not verifier and not has_reward(cfg) and not distilled:
        raise ConfigError(
            f"data.reward_functions: task {cfg.task!r} has no built-in verifier; give at least "
            "one reward function (or a data.environment or data.agent that gives rewards, or a "
            "distillation.teacher for pure distillation)"
        )


class Task:
    """Data, prompts and rewards of one run; build it with `make_task`.

    Pickling keeps only (data_cfg, seed, val_set): the copy is rebuilt with `load_data=False`,
    so a Ray worker can format prompts and score without the data files; the data order stays
    with the trainer's Task. `val_set`: this Task is the data.val_sets entry of that name (`cfg`
    its resolved DataConfig): held-out records only, messages name data.val_sets.<name>.
    """

    def __init__(
        self,
        cfg: DataConfig,
        seed: int,
        load_data: bool = True,
        val_set: Optional[str] = None,
        *,
        train_dataset: Optional[Table] = None,
        eval_dataset: Optional[Table] = None,
        distilled: bool = False,
    ):
        if cfg.task not in _KINDS:
            raise ConfigError(
                f"data.task: {cfg.task!r} is not allowed; choose one of "
                f"{', '.join(map(repr, _KINDS))}"
            )
        check_rewards_given(cfg, distilled)
        self.cfg = cfg
        self.distilled = bool(distilled)
        """A distillation.teacher grades the rollouts (no reward term needed)."""
        self.seed = int(seed)
        self.val_set = val_set
        self.kind = _KINDS[cfg.task](cfg)
        self.has_verifier = getattr(self.kind, "has_verifier", True)
        vf_id, args = env_id(cfg.environment), dict(cfg.environment_args)
        self.agent_terms: Optional[tuple[str, ...]] = None
        """A verifiers environment's reward components (jgrpo.tasks.verifiers_env), else None."""
        if vf_id is not None:
            records, self.agent_terms = describe(vf_id, args)
            if train_dataset is None and cfg.train_path is None:
                train_dataset = [{cfg.prompt_key: r["prompt"], **r} for r in records]
        env_terms = (ENVIRONMENT_TERM,) if cfg.environment is not None else ()
        self.reward_names = (
            tuple(rf.label for rf in cfg.reward_functions)
            + (self.agent_terms if vf_id is not None else env_terms)
            + (() if cfg.agent is None else (AGENT_TERM,))
        )
        functions = [i for i, rf in enumerate(cfg.reward_functions) if rf.model is None]
        self._function_indices = functions
        self._runner = RewardRunner(
            [cfg.reward_functions[i] for i in functions],
            cfg.reward_timeout_s,
            cfg.reward_import_timeout_s,
            indices=functions,
            key="data.reward_functions"
            if val_set is None
            else f"data.val_sets.{val_set}.reward_functions",
        )
        builtin = tuple(getattr(self.kind, "tools", ()))
        self.tool_runner = ToolRunner(
            [*builtin, *cfg.tools],
            [f"data.task ({cfg.task}'s tool {t!r})" for t in builtin]
            + [f"data.tools[{i}]" for i in range(len(cfg.tools))],
            None if vf_id is not None else cfg.environment,
            cfg.tool_timeout_s,
            cfg.reward_import_timeout_s,
            cfg.tool_processes,
        )
        """Runs the tools (the task's own, then data.tools) and the environment."""
        agent = functools.partial(episode, vf_id, args) if vf_id is not None else cfg.agent
        self.agent_runner = (
            None
            if agent is None
            else AgentRunner(
                agent,
                cfg.agent_timeout_s,
                cfg.reward_import_timeout_s,
                cfg.tool_processes,
                key="data.agent" if vf_id is None else "data.environment",
            )
        )
        """Runs data.agent's rollouts (jgrpo.rollout.agent_rollout), None without one."""
        self.reward_models: dict[int, Any] = {}
        """{index in data.reward_functions: jgrpo.models.reward_model.RewardModel}, attached
        by whoever scores (`attach_reward_models`): the trainer, or a Ray rollout worker."""
        self._train = self._val = None
        if load_data and val_set is not None:
            rows = self._rows(None, cfg.val_path, f"data.val_sets.{val_set}.path", "val")
            self._val = rows[: cfg.num_val_examples]
        elif load_data:
            self._train, self._val = self._build_data(train_dataset, eval_dataset)
        self.val_tasks: dict[str, Task] = {}
        """The data.val_sets entries by name, each a val-only Task (its prompts and scoring)."""
        for vs in cfg.val_sets:
            vt = Task(vs.data_config(cfg), seed, load_data, vs.name, distilled=distilled)
            if vt.cfg.reward_functions == cfg.reward_functions:
                vt._runner = self._runner  # the same terms: one reward process, not two
            self.val_tasks[vs.name] = vt
        if load_data and val_set is None:
            self.check_reward_models()
            # the reward start-up checks, before any model loads; likewise tools and environment
            for runner in {id(r): r for r in self._runners()}.values():
                runner.start()
            self.tool_runner.start()
            if self.agent_runner is not None:
                self.agent_runner.start()

    def __reduce__(self):
        return (
            functools.partial(Task, distilled=self.distilled),
            (self.cfg, self.seed, False, self.val_set),
        )

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
        """The fixed held-out examples (data.num_val_examples of them, or fewer if capped;
        none for record data without data.val_path, eval_dataset or data.val_fraction)."""
        if self._val is None:
            raise RuntimeError("this Task was built without data (load_data=False or unpickled)")
        return self._val

    def _build_data(self, train_dataset, eval_dataset):
        cfg = self.cfg
        train = self._rows(train_dataset, cfg.train_path, "data.train_path", "train")
        val = self._rows(eval_dataset, cfg.val_path, "data.val_path", "val")
        if val is not None:
            if cfg.val_fraction is not None:
                raise ConfigError(
                    "data.val_fraction: give eval_dataset (or data.val_path) or "
                    "data.val_fraction, not both"
                )
            val = val[: cfg.num_val_examples]
        if train is None:
            if cfg.task in _NEEDS_RECORDS:
                what = (
                    "a prompt dataset"
                    if cfg.task == "prompts"
                    else "question/answer records ending in '#### N'"
                )
                raise ConfigError(
                    f"data.train_path: task {cfg.task!r} needs {what}: a JSONL / JSON / Parquet "
                    "/ CSV file, datasets folder or cached HF dataset id (or train_dataset= "
                    "from Python)"
                )
            if cfg.val_fraction is not None:
                raise ConfigError(
                    f"data.val_fraction: task {cfg.task!r} generates its training examples and "
                    "holds out its own validation set; there are no records to split"
                )
            if val is not None:
                return SyntheticStream(self._make_generator(set()), self.seed), val
            self._check_space()
            val, keys = self._synthetic_val()
            return SyntheticStream(self._make_generator(keys), self.seed), val
        if cfg.val_fraction is not None:
            n, f = len(train), cfg.val_fraction
            num_val = round(f * n)
            if not 1 <= num_val < n:
                raise ConfigError(
                    f"data.val_fraction: {f} of {n} training records holds out {num_val}; "
                    "need at least 1 held out and 1 to train on"
                )
            train_idx, val_idx = split_indices(n, num_val)
            val = [train[int(i)] for i in val_idx[: cfg.num_val_examples]]
            train = Rows(train.table, train.make, train_idx)
        return RecordStream(train, self.seed, cfg.shuffle), val or []

    def _rows(self, dataset, path: Optional[str], key: str, split: str) -> Optional[Rows]:
        """Examples of a Python dataset (preferred) or of the file/folder/id at `path`."""
        if dataset is not None:
            where = "train_dataset" if split == "train" else "eval_dataset"
            check_records(dataset, where)
            table = dataset
        elif path is not None:
            where = f"{key} {path!r}"
            table = load_table(path, key, split, self.cfg.dataset_config)
        else:
            return None
        # ids name the record in its source: "train/<i>" for train and its held-out split
        prefix = "train" if split == "train" else "val"
        kind, cfg = self.kind, self.cfg

        def make(record: dict, index: int) -> Example:
            example = kind.example_from_record(record, index, where, cfg)
            example["id"] = f"{prefix}/{index}"
            return example

        if hasattr(kind, "check_table"):
            kind.check_table(table, where)
        else:  # built-in tasks: check every record now, so a bad one is named before training
            for index, record in enumerate(table):
                kind.example_from_record(dict(record), index, where, cfg)
        return Rows(table, make)

    def _check_space(self) -> None:
        """A generated task needs >= 2 distinct questions: >= 1 held out, >= 1 to train on."""
        size = self.kind.space_size
        if size >= 2:
            return
        keys = ", ".join(f"data.{k}={getattr(self.cfg, k)!r}" for k in self.kind.space_keys)
        raise ConfigError(
            f"{keys}: the {self.cfg.task} task has {size} distinct question"
            f"{'' if size == 1 else 's'}; a validation set disjoint from training needs >= 2 "
            "(widen these, or give data.val_path)"
        )

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

    @property
    def needs_chat_template(self) -> bool:
        """The loaded data holds chat-message prompts (known after the data checks)."""
        return bool(getattr(self.kind, "has_messages", False))

    def _messages(self, example: Example) -> list[dict]:
        if hasattr(self.kind, "messages"):
            return self.kind.messages(example)
        return [{"role": "user", "content": self.kind.instruction(example)}]

    def format_prompt(
        self,
        example: Example,
        tokenizer: Any = None,
        tools: Optional[list[dict]] = None,
        observation: Optional[str] = None,
    ) -> str:
        """Prompt text: the chat template when data.wraps_string_prompts and the tokenizer has one
        (encode it with add_special_tokens=False), else the task's bare prompt; a chat-message
        prompt (task prompts) always uses the template (see `jgrpo.tasks.prompts`), and so do
        `tools` (JSON schemas, the template's `tools=`) and an environment's first
        `observation` (one more user message)."""
        template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
        bare = self.kind.bare_prompt(example)
        chat = tools or observation is not None
        if bare is not None and not chat and not (self.cfg.wraps_string_prompts and template):
            return bare
        if not template:
            raise ValueError(
                f"record {example.get('id')}: the prompt is a list of chat messages (or has tools "
                "or an observation), but the tokenizer has no chat template"
            )
        messages = self.prompt_messages(example, observation)
        system = self.cfg.system_prompt
        render = functools.partial(
            tokenizer.apply_chat_template, tools=tools, add_generation_prompt=True, tokenize=False
        )
        try:
            return render(messages)
        except Exception:  # noqa: BLE001 - templates without a system role (e.g. Gemma)
            if not system or messages[0].get("content") != system:
                raise
            first = messages[1]
            return render([{**first, "content": f"{system}\n\n{first['content']}"}, *messages[2:]])

    def prompt_messages(self, example: Example, observation: Optional[str] = None) -> list[dict]:
        """The chat messages of the prompt (data.system_prompt first unless the record has a
        system message; an environment's first `observation` last): what `format_prompt`
        renders, and the start of a warm-start conversation (`ChatFormat.encode`)."""
        messages = self._messages(example)
        if observation is not None:
            messages = [*messages, {"role": "user", "content": observation}]
        system = self.cfg.system_prompt
        if system and messages[0].get("role") != "system":
            messages = [{"role": "system", "content": system}, *messages]
        return messages

    def columns(self, example: Example) -> dict:
        """The dataset record of `example` (an environment's reset(**record)): the whole row
        for file data of task prompts, else the example's fields."""
        return dict(example["row"]) if "row" in example else dict(example)

    def reference_completion(self, example: Example) -> str:
        """The ideal completion in the bare format, without EOS (the SFT warm-start target);
        the verifier scores it correct under chat prompts too."""
        return self.kind.reference_completion(example)

    # ------------------------------------------------------------------------- rewards

    def verify(self, completion: str, example: Example) -> bool:
        """The task verifier alone: is the completion's final answer correct?"""
        return bool(self.kind.verify(completion, example))

    def check_reward_models(self) -> None:
        """The reward models' pre-flight (folders, heads, lengths): ConfigError, nothing loaded."""
        from jgrpo.models.sources import check_reward_model_path

        for i, rf in enumerate(self.cfg.reward_functions):
            if rf.model is not None:
                check_reward_model_path(rf.model, f"data.reward_functions[{i}]", rf.max_length)

    def attach_reward_models(self, models: dict) -> None:
        """Use these loaded reward models (`jgrpo.models.reward_model.load_reward_models`),
        here and in the validation sets that inherit data.reward_functions."""
        self.reward_models = dict(models)
        for vt in self.val_tasks.values():
            if vt.cfg.reward_functions == self.cfg.reward_functions:
                vt.attach_reward_models(models)

    def votes(self, completions: Sequence[str]) -> Optional[list[Optional[str]]]:
        """Each completion's final answer as maj@n votes on it (the verifier's extraction,
        canonical), None for no answer; None for a task without a verifier."""
        if not hasattr(self.kind, "vote"):
            return None
        return [self.kind.vote(c) for c in completions]

    def start_rewards(self) -> None:
        """Run the reward start-up check now (a Task built with load_data=False skips it)."""
        self._runner.start()

    def _runners(self) -> list[RewardRunner]:
        return [self._runner, *(vt._runner for vt in self.val_tasks.values())]

    def score(
        self,
        prompts: Sequence[str],
        completions: Sequence[str],
        examples: Sequence[Example],
        completion_ids: Optional[Sequence[Sequence[int]]] = None,
        conversations: Optional[Sequence[list[dict]]] = None,
        environment_rewards: Optional[np.ndarray] = None,
    ) -> tuple[np.ndarray, dict]:
        """Rewards float32[N] = task_reward_weight * correct + sum_i weight_i * fn_i(...) over
        the functions that returned a value for the row (see `jgrpo.tasks.rewards`), + the
        environment's reward (weight 1; NaN = none, like a None; [N, K]: K terms).

        Multi-turn: `completions` are the last assistant turns (the verifier reads them),
        `conversations` the messages after each prompt, which reward functions and reward
        models receive as their completions (TRL's convention).

        info: accuracy (fraction the verifier marked correct; None without a verifier),
        num_reward_errors, num_reward_timeouts (samples whose call raised / ran out of time;
        they score 0 from that function), num_reward_none (None results), correct bool[N] (None
        without a verifier), custom_rewards float32[F, N] (unweighted; 0 where not OK),
        reward_model_s (seconds the reward models held the caller: re-tokenising and starting
        their forwards, then waiting for what the verifier and the functions did not overlap;
        a model's scores are always OK),
        reward_terms float32[N, F] (NaN where not OK), sample_mask bool[N] (False where no term
        gave a value), reward_status int8[N, F] (OK / ERROR / TIMEOUT / NONE of each term),
        failures [jgrpo.tasks.child.Failure]: each function's first failure in this batch (for
        `report_failures` in the trainer process; fatal under data.reward_errors: raise).
        """
        n = len(completions)
        if not len(prompts) == len(examples) == n:
            raise ValueError(
                f"score: {len(prompts)} prompts, {n} completions, {len(examples)} examples"
            )
        if hasattr(self.kind, "reward_inputs"):
            pairs = [
                self.kind.reward_inputs(e, p, c) for e, p, c in zip(examples, prompts, completions)
            ]
            r_prompts, r_completions = [p for p, _ in pairs], [c for _, c in pairs]
            records = [self.kind.reward_record(e) for e in examples]
        else:
            r_prompts, r_completions, records = list(prompts), list(completions), list(examples)
        if conversations is not None:
            r_completions = [list(c) for c in conversations]
        # the reward models' forwards first: they run on the device while the verifier and
        # the reward functions (a child process) run on the host
        start = time.perf_counter()
        pending = {}
        for f, rf in enumerate(self.cfg.reward_functions):
            if rf.model is None:
                continue
            if f not in self.reward_models:
                raise RuntimeError(
                    f"data.reward_functions[{f}].model {rf.model!r} is not loaded in this "
                    "process (attach it: Task.attach_reward_models)"
                )
            pending[f] = self.reward_models[f].dispatch(r_prompts, r_completions)
        model_s = time.perf_counter() - start
        num_errors = 0
        correct = None
        rewards = np.zeros(n, np.float64)
        if self.has_verifier:
            correct = np.zeros(n, bool)
            for j, (completion, example) in enumerate(zip(completions, examples)):
                try:
                    correct[j] = self.kind.verify(completion, example)
                except Exception:  # noqa: BLE001 - a malformed example must not stop the run
                    num_errors += 1
            rewards += self.cfg.task_reward_weight * correct.astype(np.float64)
        env = None  # [K, N]: the environment's (or a verifiers environment's K) terms
        if environment_rewards is not None:
            env = np.asarray(environment_rewards, np.float64).reshape(n, -1).T
        num_terms = len(self.cfg.reward_functions) + (0 if env is None else len(env))
        values = np.zeros((num_terms, n), np.float64)
        status = np.zeros((num_terms, n), np.int8)
        fn_values, fn_status, problems = self._runner.run(
            r_prompts, r_completions, records, completion_ids
        )
        values[self._function_indices], status[self._function_indices] = fn_values, fn_status
        failures = [self._failure(f, *problem, examples) for f, problem in problems.items()]
        start = time.perf_counter()
        for f, scores in pending.items():
            values[f] = scores.result()
        model_s += time.perf_counter() - start
        if env is not None:
            given = ~np.isnan(env)
            values[num_terms - len(env) :] = np.where(given, env, 0.0)
            status[num_terms - len(env) :] = np.where(given, OK, NONE)
        ok = status == OK
        weights = [rf.weight for rf in self.cfg.reward_functions]
        weights += [1.0] * (num_terms - len(weights))  # the environment's term
        for f, weight in enumerate(weights):
            rewards += weight * np.where(ok[f], values[f], 0.0)
        has_value = (status != NONE).any(axis=0)
        if self.has_verifier and self.cfg.task_reward_weight != 0:
            has_value[:] = True
        info = {
            "accuracy": float(correct.mean()) if correct is not None and n else None,
            "num_reward_errors": num_errors + int((status == ERROR).sum()),
            "num_reward_timeouts": int((status == TIMEOUT).sum()),
            "num_reward_none": int((status[: len(self.cfg.reward_functions)] == NONE).sum()),
            "correct": correct,
            "custom_rewards": np.where(ok, values, 0.0).astype(np.float32),
            "reward_terms": np.where(ok, values, np.nan).T.astype(np.float32),
            "sample_mask": has_value,
            "reward_model_s": model_s,
            "reward_status": status.T.copy(),
            "failures": failures,
        }
        return rewards.astype(np.float32), info

    def _failure(self, f: int, first: int, last: int, text: str, examples) -> Failure:
        """The report of the runner's function f's first failure in a batch (at samples
        first..last: one, or a batched call's)."""
        index = self._function_indices[f]
        label = self.cfg.reward_functions[index].label
        where = f"samples {first}-{last} (one batched call)"
        if first == last:
            rid = examples[first].get("id")
            where = f"sample {first}" + ("" if rid is None else f" (record {rid})")
        return Failure(
            name=f"{self._runner.key}[{index}] ({label!r})",
            where=where,
            text=text,
            counter=f"reward/{label}/num_errors",
            fatal=self.cfg.reward_errors == "raise",
        )

    def close(self) -> None:
        """Stop the reward child processes, if any (they also die with this process)."""
        self._runner.close()
        self.tool_runner.close()
        if self.agent_runner is not None:
            self.agent_runner.close()
        for vt in self.val_tasks.values():
            vt.close()


def make_task(data_cfg: DataConfig, seed: int, **options: Any) -> Task:
    """Validate `data_cfg` (files, fields, the reward start-up check) and build the Task.

    Raises ConfigError (one line naming the dotted key or file) before any model loads.
    `options` are Task's keywords: `load_data=False` skips reading data and the reward check
    (rollout workers that only format and score); `train_dataset` / `eval_dataset` (a list of
    dicts or a `datasets.Dataset`) replace data.train_path / data.val_path; `distilled`: the
    run has a distillation.teacher, so a task without a verifier needs no reward function.
    """
    return Task(data_cfg, seed, **options)


def run_task(cfg: Config, **options: Any) -> Task:
    """The task of the GRPO run `cfg`: `make_task` on its data and seed, `distilled` when it has
    a distillation.teacher (the one place that decides it). `options` as for make_task."""
    return make_task(
        cfg.data, cfg.grpo.seed, distilled=cfg.distillation.teacher is not None, **options
    )
