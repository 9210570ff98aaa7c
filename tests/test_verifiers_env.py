"""`data.environment: "verifiers:<id>"`: Prime Intellect `verifiers` (v1) tasksets as rollouts.

The tasksets are modules written here (nothing downloaded): a single-turn one (one chat call;
two weighted rewards) and a tool one (its harness offers a calculator tool, runs the model's
calls and answers; rewards: exact answer, a tool was used). Their harnesses run in-process
(verifiers' built-in chat harness installs its program with uv, from the network). Fast: the
config checks and one episode of the real verifiers stack (interception server, Env, rubric)
against jgrpo's endpoint with a scripted sampler: the exact ids and logprobs. Heavy: the engine
with a real tiny model and the episodes in the contained child: the trainer's forward
reproduces every recorded logprob, the loss mask, the components as reward/<name>/mean."""

import asyncio
import threading

import jax
import numpy as np
import openai
import pytest
from conftest import assert_agent_batch_is_the_trainers, importable_modules
from flax import nnx
from test_agents import SETTINGS, Script, expected_logprobs

from jgrpo.config import ConfigError, load_config
from jgrpo.models import from_pretrained
from jgrpo.rollout import build_engine
from jgrpo.rollout.conversation import ChatFormat
from jgrpo.rollout.endpoint import Endpoint
from jgrpo.tasks import make_task, verifiers_env

pytest.importorskip("verifiers.v1")

SINGLE = '''
import openai
import verifiers.v1 as vf
from verifiers.v1.runtimes import ProgramResult


class AddData(vf.TaskData):
    answer: int


class AddTask(vf.Task[AddData]):
    @vf.reward
    async def exact(self, trace: vf.Trace) -> float:
        return float((trace.last_reply or "").strip() == str(self.data.answer))

    @vf.reward(weight=0.5)
    async def short(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply or "") <= 3)


class AddConfig(vf.TasksetConfig):
    num_tasks: int = 4


class AddTaskset(vf.Taskset[AddTask, AddConfig]):
    def load(self):
        return [
            AddTask(AddData(idx=i, prompt=f"{i}+{i}=", answer=2 * i), self.config.task)
            for i in range(self.config.num_tasks)
        ]


class ChatHarness(vf.Harness[vf.HarnessConfig]):
    """One chat call, in-process, through the interception endpoint verifiers gives."""

    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def setup(self, runtime):
        pass

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **kw):
        _, prompt = self.resolve_prompt(data)
        async with openai.AsyncOpenAI(base_url=endpoint, api_key=secret) as client:
            r = await client.chat.completions.create(
                model=ctx.model, messages=[{"role": "user", "content": prompt}], max_tokens=32
            )
        return ProgramResult(0, r.choices[0].message.content or "", "")


__all__ = ["AddTaskset", "ChatHarness"]
'''

TOOLS = '''
import json

import openai
import verifiers.v1 as vf
from verifiers.v1.runtimes import ProgramResult

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate a product a*b.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


class MulData(vf.TaskData):
    answer: int


class MulTask(vf.Task[MulData]):
    @vf.reward
    async def exact(self, trace: vf.Trace) -> float:
        return float((trace.last_reply or "").strip() == str(self.data.answer))

    @vf.reward(weight=0.25)
    async def used_tool(self, trace: vf.Trace) -> float:
        return float(len(trace.calls) > 1)


class MulTaskset(vf.Taskset[MulTask, vf.TasksetConfig]):
    def load(self):
        pairs = [(3, 4), (6, 7)]
        return [
            MulTask(MulData(idx=i, prompt=f"{a}*{b}=", answer=a * b), self.config.task)
            for i, (a, b) in enumerate(pairs)
        ]


class ToolHarness(vf.Harness[vf.HarnessConfig]):
    """A tool loop, in-process: offers the calculator, runs the model's calls, asks again."""

    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def setup(self, runtime):
        pass

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **kw):
        _, prompt = self.resolve_prompt(data)
        messages = [{"role": "user", "content": prompt}]
        async with openai.AsyncOpenAI(base_url=endpoint, api_key=secret) as client:
            for _ in range(3):
                r = await client.chat.completions.create(
                    model=ctx.model, messages=messages, tools=[CALCULATOR], max_tokens=100
                )
                message = r.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                if not message.tool_calls:
                    break
                for call in message.tool_calls:
                    try:
                        args = json.loads(call.function.arguments)
                        result = str(int(args["a"]) * int(args["b"]))
                    except Exception as e:
                        result = f"error: {e}"
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return ProgramResult(0, message.content or "", "")


__all__ = ["MulTaskset", "ToolHarness"]
'''


@pytest.fixture(scope="module")
def tasksets(tmp_path_factory):
    sources = {"jgrpo_vf_single": SINGLE, "jgrpo_vf_tools": TOOLS}
    for _ in importable_modules(tmp_path_factory, sources):
        yield


def run_episode(tok, taskset, args, index, reply):
    """verifiers_env.episode of task `index` on a client thread while this thread serves a
    jgrpo endpoint whose scripted sampler writes reply(prompt text) -> (its Rollout, result)."""
    endpoint = Endpoint(tok, ChatFormat(tok, [tok.eos_token_id]).stop_ids, gather_s=0.05)
    endpoint.start()
    script = Script(tok, reply if callable(reply) else lambda p: reply)
    ids = endpoint.open([0], SETTINGS)
    out = {}

    def run():
        async def main():
            url = endpoint.base_url(ids[0])
            async with openai.AsyncOpenAI(base_url=url, api_key=endpoint.api_key) as client:
                return await verifiers_env.episode(taskset, args, client, {"vf_task": index})

        out["result"] = asyncio.run(main())

    thread = threading.Thread(target=run)
    thread.start()
    try:
        while thread.is_alive():
            endpoint.step(script, 1)
    finally:
        (rollout,) = endpoint.close_rollouts(ids)
        endpoint.close()
    return rollout, out["result"]


def _cfg(*overrides):
    return load_config(None, ["data.task=prompts", "rollout.max_turns=4", *overrides])


def test_verifiers_environments_are_checked_and_run_against_the_endpoint(tasksets, tok):
    """Bad ids, args and keys are one-line ConfigErrors; one episode of the real verifiers
    stack (its interception server relays the harness's call to jgrpo's endpoint) records the
    exact ids and logprobs, and the rubric's weighted components come back."""
    with pytest.raises(ConfigError, match="data.environment_args: only for"):
        load_config(None, ["data.environment_args={a: 1}"])
    with pytest.raises(ConfigError, match="set data.task: prompts"):
        load_config(None, ["data.environment=verifiers:x", "rollout.max_turns=2"])
    with pytest.raises(ConfigError, match=r"verifiers:no_such_taskset .*not found") as e:
        verifiers_env.describe("no_such_taskset", {})
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="data.environment_args.*num_tasks"):
        verifiers_env.describe("jgrpo_vf_single", {"num_tasks": "many"})
    with pytest.raises(ConfigError, match="BrowserUseHarness needs a container"):
        verifiers_env.describe("jgrpo_vf_single", {"harness": {"id": "browser_use"}})
    records, names = verifiers_env.describe("jgrpo_vf_single", {"num_tasks": 3})
    assert names == ("exact", "short")
    assert records == [{"prompt": f"{i}+{i}=", "vf_task": i} for i in range(3)]

    rollout, result = run_episode(tok, "jgrpo_vf_single", {"num_tasks": 3}, 2, "4<|im_end|>")
    # task 2 asks 2+2=: the reply "4" is exact (1 x 1) and short (1 x weight 0.5)
    terms = {"exact": 1.0, "short": 0.5}
    assert result == {"reward": 1.5, "completion": "4", "terms": terms}
    (call,) = rollout.calls
    (seq,) = rollout.sequences
    four = tok("4<|im_end|>", add_special_tokens=False)["input_ids"]
    assert seq.region == four and seq.generated == [True] * len(four)
    assert seq.prompt == ChatFormat(tok, [tok.eos_token_id]).prompt_ids(
        [{"role": "user", "content": "2+2="}]
    )
    np.testing.assert_array_equal(np.float32(seq.logprobs), expected_logprobs(len(four), 0))


def test_a_verifiers_tool_episode_continues_token_in_token_out(tasksets, tok):
    """The tool taskset's harness offers the calculator through verifiers' interception
    server: the model's tool call is parsed back, its result goes in, the second call extends
    the first call's ids (one sequence: the model's ids in the mask, the template's not)."""
    call = '<tool_call>\n{"name": "calculator", "arguments": {"a":3,"b":4}}\n</tool_call><|im_end|>'
    reply = lambda p: "12<|im_end|>" if "<tool_response>" in p else call  # noqa: E731
    rollout, result = run_episode(tok, "jgrpo_vf_tools", {}, 0, reply)
    assert result == {
        "reward": 1.25,
        "completion": "12",
        "terms": {"exact": 1.0, "used_tool": 0.25},
    }
    first, second = rollout.calls
    (seq,) = rollout.sequences
    call_ids = tok(call, add_special_tokens=False)["input_ids"]
    answer = tok("12<|im_end|>", add_special_tokens=False)["input_ids"]
    assert seq.region[: len(call_ids)] == call_ids and seq.region[-len(answer) :] == answer
    n_reply = len(seq.region) - len(call_ids) - len(answer)
    assert seq.generated == [True] * len(call_ids) + [False] * n_reply + [True] * len(answer)
    want = [*expected_logprobs(len(call_ids), 0), *[0.0] * n_reply]
    want += list(expected_logprobs(len(answer), 16))  # row 0, call 1, choice 0
    np.testing.assert_array_equal(np.float32(seq.logprobs), np.float32(want))


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    from jgrpo.models.tiny import build_tiny_model

    return AutoTokenizer.from_pretrained(
        build_tiny_model(tmp_path_factory.mktemp("tok") / "m", chat=True)
    )


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    from test_multiturn import focused_model

    return focused_model(tmp_path_factory.mktemp("vf_model") / "m")


@pytest.mark.heavy
@pytest.mark.parametrize("taskset", ["jgrpo_vf_single", "jgrpo_vf_tools"])
def test_verifiers_rollouts_train_on_exactly_the_sampled_tokens(tasksets, chat_model, taskset):
    """The engine with a real tiny model: each verifiers episode runs in the contained child
    against the rollout's endpoint; the trainer's forward reproduces every recorded logprob,
    the mask is the model's ids, and the rubric's components are the reward terms."""
    cfg = _cfg(
        f"model.path={chat_model}",
        f"data.environment=verifiers:{taskset}",
        "grpo.num_prompts_per_step=2",
        "grpo.num_generations_per_prompt=2",
        "data.tool_processes=1",
        "rollout.max_new_tokens=96",
        "rollout.prompt_bucket=32",
    )
    engine, graphdef = build_engine(cfg, chat_model)
    engine.task.agent_runner.start()
    params = nnx.state(from_pretrained(chat_model))
    data = make_task(cfg.data, 0, load_data=True)  # the taskset's records are the dataset
    examples = data.train.next_prompts(2)
    data.close()
    assert all(set(e["row"]) == {"prompt", "vf_task"} for e in examples), examples
    try:
        result = engine.rollout(graphdef, params, examples, jax.random.key(0), 0, 2)
    finally:
        engine.task.close()
    names = {"jgrpo_vf_single": ("exact", "short"), "jgrpo_vf_tools": ("exact", "used_tool")}
    assert tuple(result.reward_names) == names[taskset]
    stats = result.stats
    assert stats["agents/errors"] == 0 and stats["agents/timeouts"] == 0, result.failures
    assert stats["agents/calls"] >= 4
    for name in names[taskset]:
        assert f"reward/{name}/mean" in stats
    batch = result.step_batch()
    terms = np.asarray(result.batch["reward_terms"])
    real = np.asarray(batch.group_ids) >= 0
    np.testing.assert_allclose(np.asarray(batch.rewards)[real], terms[real].sum(1), rtol=1e-6)
    assert_agent_batch_is_the_trainers(graphdef, params, result, cfg.rollout)


@pytest.mark.heavy
def test_grpo_trainer_trains_on_a_verifiers_environment(tasksets, chat_model, tmp_path):
    """Two steps through train.run: the components are logged as reward/<name>/mean and the
    train step's forward reproduces the endpoint's logprobs."""
    import jgrpo
    from jgrpo.metrics import read_metrics

    trainer = jgrpo.GRPOTrainer(
        None,
        environment="verifiers:jgrpo_vf_single",
        run_dir=tmp_path / "run",
        overrides=[
            f"model.path={chat_model}",
            "data.task=prompts",
            "data.environment_args={num_tasks: 8}",
            "grpo.num_prompts_per_step=2",
            "grpo.num_generations_per_prompt=4",
            "grpo.max_num_steps=2",
            "grpo.val_period=0",
            "rollout.max_new_tokens=64",
            "rollout.prompt_bucket=32",
            "rollout.max_turns=2",
            "data.tool_processes=1",
        ],
    )
    trainer.train()
    rows = [r for r in read_metrics(tmp_path / "run") if r["step"] > 0]
    assert len(rows) == 2
    for r in rows:
        assert r["agents/calls"] == 8 and r["agents/errors"] == 0
        assert "reward/exact/mean" in r and "reward/short/mean" in r
        assert 1.0 <= r["logprob/token_mult_prob_error"] <= 1.001
        assert r["agents/sampler_batch_max"] > 1  # the episodes' calls meet in batches
