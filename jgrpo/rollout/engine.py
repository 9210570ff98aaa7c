"""The rollout core shared by every backend: prompts -> completions -> scored numpy batch.

`RolloutEngine` holds the tokenizer, the task (for prompts and rewards) and the sampling
settings; it does not own weights: each call receives the (graphdef, params) to sample from, so
the in-process backend samples from the trainer's own arrays and a Ray worker from its copy.

The batch it returns (numpy) holds the trainer's input, the fields of `jgrpo.batch.TrainBatch`
(`RolloutResult.step_batch()`; group_ids = the prompt's index in the step), plus rollout
statistics: weight_version [B] (the params version each row was sampled with), lengths [B],
truncated [B] and correct [B]. Every rollout runs the turn loop (`jgrpo.rollout.turns`): with one
turn and no tools or environment it is the single-turn rollout; otherwise the completion region
is a conversation (lengths count its generated and reply ids) and the batch adds the per-row
counts `turns.ROW_COUNTS`. B = len(examples) x G; T = P + N with P the bucketed prompt width and
N = max_new_tokens."""

from __future__ import annotations

import dataclasses
import functools
import time
import zlib
from typing import Any

import jax
import numpy as np

from jgrpo import distillation, sampling
from jgrpo.config import Config, ConfigError
from jgrpo.rollout import agent_rollout, dapo, turns
from jgrpo.rollout.conversation import ChatFormat
from jgrpo.rollout.results import RolloutResult, batch_stats
from jgrpo.tasks.child import OK, TIMEOUT


class RolloutEngine:
    """Turns examples into a scored batch with the given params (see module docstring)."""

    def __init__(self, cfg: Config, model_cfg, tokenizer, task):
        self.cfg = cfg
        self.model_cfg = model_cfg
        self.tokenizer = tokenizer
        self.task = task
        tasks = {"data": task, **{f"data.val_sets.{k}": v for k, v in task.val_tasks.items()}}
        for where, t in tasks.items():
            if getattr(t, "needs_chat_template", False) and not tokenizer.chat_template:
                what = (
                    f"{where}.prompt_key: the dataset has chat-message prompts"
                    if t.cfg.task == "prompts"
                    else f"{where}.task: the {t.cfg.task} task's prompts are chat messages"
                )
                raise ConfigError(
                    f"{what} but the tokenizer of model.path {cfg.model.path!r} has no chat "
                    "template: give string prompts or a model with one (builtin:tiny-qwen2-chat "
                    "for the tiny model)"
                )
        runner = task.tool_runner
        self.turn_settings = turns.TurnSettings.from_config(
            cfg, tools=bool(runner.tools), environment=runner.environment is not None
        )
        self.multi_turn = cfg.rollout.max_turns > 1 or runner.active
        """Tools, an environment or several turns: conversations, not single completions."""
        if self.multi_turn and not tokenizer.chat_template:
            raise ConfigError(
                "rollout.max_turns / data.tools / data.environment: multi-turn rollouts need a "
                f"chat template, and the tokenizer of model.path {cfg.model.path!r} has none"
            )
        self._chat: ChatFormat | None = None
        self._endpoint = None
        stops = tuple(t for t in (tokenizer.eos_token_id,) if t is not None)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else None
        record = records_routing(cfg, model_cfg)
        if record and self.multi_turn:
            raise ConfigError(
                "model.moe.router_replay / record_routing: recorded routing covers single-turn "
                "rollouts only; set rollout.max_turns: 1 and no data.tools or data.environment"
            )
        self.train_params = sampling.SamplingParams.from_rollout_config(
            cfg.rollout, stop_token_ids=stops, pad_id=pad, record_experts=record
        )
        self.greedy_params = dataclasses.replace(
            self.train_params, temperature=0.0, top_p=1.0, top_k=None, record_experts=False
        )
        val_t = cfg.rollout.val_temperature
        self.val_params = self.train_params
        if val_t is not None:  # validation samples (not greedy) at rollout.val_temperature
            self.val_params = dataclasses.replace(self.train_params, temperature=val_t)
        self.val_params = dataclasses.replace(self.val_params, record_experts=False)

    @functools.lru_cache(maxsize=4096)  # noqa: B019 - prompts repeat across epochs
    def _encode(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompts(self, examples, observations=None, task=None) -> tuple[list[str], list[list[int]]]:
        """(prompt texts, token ids) of `examples` in `task`'s format (default: the run's);
        multi-turn prompts carry the tools' schemas, and each an environment's first
        observation when `observations` are given (one per example)."""
        task = task or self.task
        observations = observations or [None] * len(examples)
        tools = self.task.tool_runner.schemas or None if self.multi_turn else None
        texts = [
            task.format_prompt(ex, self.tokenizer, tools, obs)
            for ex, obs in zip(examples, observations)
        ]
        return texts, [list(self._encode(t)) for t in texts]

    def task_of(self, val_set: str | None):
        """The Task that prompts and scores `val_set` (None: the run's own task)."""
        return self.task if val_set is None else self.task.val_tasks[val_set]

    @property
    def chat(self) -> ChatFormat:
        """Reply ids under the tokenizer's template (built on first use: needs the schemas)."""
        if self._chat is None:
            tools = self.task.tool_runner.schemas or None
            spec = sampling.make_decode_spec(self.model_cfg, self.train_params)
            self._chat = ChatFormat(self.tokenizer, spec.stop_token_ids, tools)
        return self._chat

    def reset_environments(
        self, examples, task=None
    ) -> tuple[list, np.ndarray, np.ndarray, np.ndarray]:
        """A fresh environment per row: (first observations, reset ok bool[B], errors int32[B],
        timeouts int32[B]) of reset(**record) (`task.columns`; default: the run's task)."""
        task = task or self.task
        runner = self.task.tool_runner
        ops = [("clear", -1, None)]
        ops += [("reset", b, task.columns(ex)) for b, ex in enumerate(examples)]
        results = runner.run(ops)[1:]
        ok = np.asarray([status == OK for status, _ in results], bool)
        observations = [value if good else None for good, (_, value) in zip(ok, results)]
        timeouts = np.asarray([status == TIMEOUT for status, _ in results], np.int32)
        return observations, ok, (~ok).astype(np.int32), timeouts

    def rollout(
        self,
        graphdef,
        params,
        examples,
        key,
        version: int,
        num_generations: int,
        greedy=False,
        first_prompt: int = 0,
        training: bool = True,
        val_set: str | None = None,
    ) -> RolloutResult:
        """Sample `num_generations` completions per example and score them; a `training`
        batch also gets DAPO's overlong shaping and filtering (`dapo.shape_training_batch`).
        `val_set`: the examples are that data.val_sets entry's, prompted and scored by its task.

        `first_prompt`: index of examples[0] in the whole step, when a step is split over
        workers; row draws depend on the global row index only, so the parts concatenated
        (`concat_results`) equal the unsplit batch."""
        task = self.task_of(val_set)
        rows = [i for i in range(len(examples)) for _ in range(num_generations)]
        row_examples = [examples[i] for i in rows]
        if greedy:
            params_s = self.greedy_params
        else:
            params_s = self.train_params if training else self.val_params
        if self.task.agent_runner is not None:
            return self._agent_rollout(
                (graphdef, params), examples, key, version, num_generations, params_s,
                first_prompt, training, task,
            )  # fmt: skip
        env = self.turn_settings.environment
        reset_s = time.perf_counter()
        if env:  # one environment per row: its first observation is part of the row's prompt
            observations, env_ok, env_errors, env_timeouts = self.reset_environments(
                row_examples, task
            )
            reset_s = time.perf_counter() - reset_s
            row_texts, row_ids = self.prompts(row_examples, observations, task)
        else:
            texts, token_lists = self.prompts(examples, task=task)
            row_texts, row_ids = [texts[i] for i in rows], [token_lists[i] for i in rows]
            env_ok, reset_s = None, 0.0
        start = time.perf_counter()
        shared = self.cfg.rollout.shared_prefill and not env  # observations may differ by row
        conv = turns.run_turns(
            (graphdef, params),
            row_ids,
            params_s,
            key,
            self.turn_settings,
            self.tokenizer,
            first_row=first_prompt * num_generations,
            group_size=num_generations if shared else 1,
            chat=self.chat if self.multi_turn else None,
            runner=self.task.tool_runner,
            environment_ok=env_ok,
        )
        looped = time.perf_counter()
        completions = conv.texts
        # the stop token included (TRL's completion_ids): len = lengths[b] = L of the overlong term
        completion_ids = [conv.tokens[b, : conv.lengths[b]].tolist() for b in range(len(rows))]
        decoded = time.perf_counter()
        rewards, info = task.score(
            row_texts,
            completions,
            row_examples,
            completion_ids,
            conversations=conv.messages if self.multi_turn else None,
            environment_rewards=conv.environment_rewards if env else None,
        )
        scored = time.perf_counter()
        batch = assemble_batch(conv, rows, rewards, version, generated=conv.generated)
        if self.multi_turn:
            batch.update(conv.counts)
            if env:
                batch["environment_errors"] = batch["environment_errors"] + env_errors
                batch["environment_timeouts"] = batch["environment_timeouts"] + env_timeouts
        batch["sample_mask"] = distillation.loss_rows(self.cfg, info["sample_mask"])
        if info["correct"] is not None:
            batch["correct"] = np.asarray(info["correct"], bool)
        names = tuple(task.reward_names)
        batch["reward_terms"] = np.asarray(info["reward_terms"], np.float32).reshape(
            len(rows), len(names)
        )
        batch["reward_status"] = np.asarray(info["reward_status"], np.int8).reshape(
            len(rows), len(names)
        )
        if training:
            dapo.shape_training_batch(batch, self.cfg)
        elif (votes := task.votes(completions)) is not None:
            batch["vote_ids"] = vote_ids(votes)
        counts = {
            "reward/num_errors": float(info["num_reward_errors"]),
            "reward/num_timeouts": float(info["num_reward_timeouts"]),
            "reward/num_none": float(info["num_reward_none"]),
            "perf/sample_s": looped - start - conv.decode_s - conv.tools_s,
            "perf/detokenize_s": decoded - looped + conv.decode_s,
            "perf/reward_s": scored - decoded,
            "perf/reward_model_s": float(info.get("reward_model_s", 0.0)),
        }
        if self.multi_turn:
            counts["perf/tools_s"] = reset_s + conv.tools_s
            for schema in self.task.tool_runner.schemas:
                tool = schema["function"]["name"]
                counts[f"tools/{tool}/num_errors"] = float(conv.tool_errors_by_name.get(tool, 0))
            # the whole conversation after the prompt, special tokens shown
            completions = [self.tokenizer.decode(ids) for ids in completion_ids]
        samples = [
            {
                "prompt": row_texts[b],
                "completion": completions[b],
                "reward": float(batch["rewards"][b]),
                **{
                    f"reward/{name}": _or_none(batch["reward_terms"][b, f])
                    for f, name in enumerate(names)
                },
            }
            for b in range(min(self.cfg.logging.num_samples, len(rows)))
        ]
        failures = list(info["failures"]) + self.task.tool_runner.take_failures()
        return RolloutResult(batch, batch_stats(batch, names) | counts, samples, names, failures)

    @property
    def endpoint(self):
        """The OpenAI-compatible endpoint agents call (jgrpo.rollout.endpoint), started on
        first use: one per engine (per run and process), with its own key."""
        if self._endpoint is None:
            from jgrpo.rollout.endpoint import Endpoint

            self._endpoint = Endpoint(
                self.tokenizer,
                self.chat.stop_ids,
                tool_call_format=self.cfg.rollout.tool_call_format,
            )
            self._endpoint.start()
        return self._endpoint

    def _agent_rollout(
        self, model, examples, key, version, g, params_s, first_prompt, training, task
    ) -> RolloutResult:
        """A data.agent rollout (jgrpo.rollout.agent_rollout): one endpoint rollout per row,
        its sequences as training rows, scored by the agent's reward and the task's terms."""
        from jgrpo.rollout.agent_record import Settings

        runner = self.task.agent_runner
        # a call also stops at the template's end of turn (ChatFormat.stop_ids)
        stops = tuple(sorted(set(params_s.stop_token_ids) | set(self.chat.stop_ids)))
        params_s = dataclasses.replace(params_s, stop_token_ids=stops)
        settings = Settings(
            budget=params_s.max_new_tokens,
            max_calls=self.cfg.rollout.max_turns,
            temperature=params_s.temperature,
            top_p=params_s.top_p,
        )
        rollouts, results, timing = agent_rollout.run_agents(
            self.endpoint, runner, model, examples, key, params_s, settings,
            first_prompt * g, task, g,
        )  # fmt: skip
        spec = sampling.make_decode_spec(self.model_cfg, params_s)
        arrays, owner, completions = agent_rollout.build_rows(
            rollouts, results, self.tokenizer, params_s.prompt_bucket, params_s.max_new_tokens,
            spec.pad_id,
        )  # fmt: skip
        rows = [i for i in range(len(examples)) for _ in range(g)]
        row_examples = [examples[i] for i in rows]
        ok = np.asarray([results.get(b, (TIMEOUT,))[0] == OK for b in range(len(rows))], bool)
        agent_rewards = agent_rollout.reward_columns(results, ok, task.agent_terms)
        prompts = [
            self.tokenizer.decode(r.sequences[0].prompt) if r.sequences else "" for r in rollouts
        ]
        start = time.perf_counter()
        rewards, info = task.score(
            prompts, completions, row_examples, environment_rewards=agent_rewards
        )
        scored = time.perf_counter()
        names = tuple(task.reward_names)
        batch = agent_rollout.score_rows(arrays, owner, rollouts, ok, rows, rewards, info, version)
        if training:
            dapo.shape_training_batch(batch, self.cfg)
        else:  # evaluation reads one row per rollout (accuracy, pass@k, maj@n): its first
            batch = {k: v[batch["agent_first_row"] > 0] for k, v in batch.items()}
            if (votes := task.votes(completions)) is not None:
                batch["vote_ids"] = vote_ids(votes)
        sizes = timing["batch_sizes"]
        counts = {
            "reward/num_errors": float(info["num_reward_errors"]),
            "reward/num_timeouts": float(info["num_reward_timeouts"]),
            "reward/num_none": float(info["num_reward_none"]),
            "perf/sample_s": timing["sample_s"],
            "perf/agent_s": timing["agent_s"] - timing["sample_s"],
            "perf/reward_s": scored - start,
            "perf/reward_model_s": float(info.get("reward_model_s", 0.0)),
            "agents/sampler_calls": float(len(sizes)),
            "agents/sampler_batch_mean": float(np.mean(sizes)) if sizes else 0.0,
            "agents/sampler_batch_max": float(max(sizes, default=0)),
        }
        samples = [
            {
                "prompt": prompts[b],
                "completion": self.tokenizer.decode(rollouts[b].sequences[-1].region)
                if rollouts[b].sequences
                else "",
                "reward": float(rewards[b]),
            }
            for b in range(min(self.cfg.logging.num_samples, len(rows)))
        ]
        failures = list(info["failures"]) + runner.take_failures()
        stats = batch_stats(batch, names) | counts
        if info["accuracy"] is not None:  # per rollout, not per row
            stats["reward/accuracy"] = info["accuracy"]
        result = RolloutResult(batch, stats, samples, names, failures)
        result.agent_rollouts = rollouts  # the endpoint's records (tests, inspection)
        result.sampler_batch_sizes = sizes
        return result


def records_routing(cfg: Config, model_cfg) -> bool:
    """The training rollouts record each fed token's experts: an MoE model (model_cfg.moe) with
    model.moe.router_replay or model.moe.record_routing."""
    moe = cfg.model.moe
    return hasattr(model_cfg, "moe") and (moe.router_replay or moe.record_routing)


def vote_ids(votes) -> np.ndarray:
    """int64[B] a number per distinct answer string (crc32; -1 = no answer): maj@n's input,
    numeric so it travels with the batch (Ray, pods)."""
    return np.asarray([-1 if v is None else zlib.crc32(v.encode()) for v in votes], np.int64)


def _or_none(value) -> float | None:
    return None if np.isnan(value) else float(value)


def assemble_batch(gen, rows, rewards, version: int, generated=None) -> dict:
    """Prompt ++ completion arrays of a `sampling.Generation` (or `turns.Conversations`): the
    TrainBatch fields plus the rollout statistics. `generated` [B, N] (multi-turn): which
    completion ids the sampler generated; the loss mask is 0 on the others (replies)."""
    b, n = gen.tokens.shape
    p = gen.prompt_tokens.shape[1]
    prompt_mask = np.arange(p)[None, :] >= (p - gen.prompt_lengths[:, None])
    gen_mask = np.arange(n)[None, :] < gen.lengths[:, None]
    loss_mask = gen_mask if generated is None else gen_mask & generated
    token_mask = np.concatenate([np.zeros((b, p), bool), loss_mask], axis=1)
    recorded = {} if gen.expert_ids is None else {"expert_ids": gen.expert_ids}
    return recorded | {
        "input_ids": np.concatenate([gen.prompt_tokens, gen.tokens], axis=1).astype(np.int32),
        "attention_mask": np.concatenate([prompt_mask, gen_mask], axis=1).astype(np.float32),
        "token_mask": token_mask.astype(np.float32),
        "generation_logprobs": np.concatenate(
            [np.zeros((b, p), np.float32), np.where(loss_mask, gen.logprobs, 0.0)], axis=1
        ).astype(np.float32),
        "rewards": np.asarray(rewards, np.float32),
        "group_ids": np.asarray(rows, np.int32),
        "sample_mask": np.ones(b, np.float32),
        "weight_version": np.full(b, version, np.int32),
        "lengths": gen.lengths.astype(np.int32),
        "truncated": gen.truncated.astype(bool),
    }


VALIDATION_SALT = 1
"""step_key salt of validation draws (training uses 0), shared by every backend."""


def train_salt(gen_batch: int) -> int:
    """step_key salt of a step's `gen_batch`-th generation batch: 0 for the first (dynamic
    sampling draws more), VALIDATION_SALT + gen_batch after it."""
    return 0 if gen_batch == 0 else VALIDATION_SALT + gen_batch


def step_key(seed: int, step: int, salt: int = 0):
    """The sampling key of training step `step` (salt separates validation draws)."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), salt), step)


def load_tokenizer(folder):
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def model_graphdef(model_cfg):
    """The NNX graph of a model config, without allocating parameters."""
    from flax import nnx

    from jgrpo.models import model_class

    abstract = nnx.eval_shape(lambda: model_class(model_cfg)(model_cfg, rngs=nnx.Rngs(0)))
    return nnx.split(abstract)[0]


def build_engine(cfg: Config, model_folder) -> tuple[RolloutEngine, Any]:
    """(engine, graphdef) from the config alone: what a rollout worker process needs. The task
    is built without its data (the trainer owns it); reward models load on this process."""
    from jgrpo.models import policy_config
    from jgrpo.models.reward_model import load_reward_models
    from jgrpo.tasks import run_task

    model_cfg = policy_config(cfg.model, model_folder)
    task = run_task(cfg, load_data=False)
    task.attach_reward_models(load_reward_models(cfg))
    engine = RolloutEngine(cfg, model_cfg, load_tokenizer(model_folder), task)
    return engine, model_graphdef(model_cfg)


class RolloutFailure(RuntimeError):
    """Rollout workers failed more often than rollout.max_worker_failures allows."""
