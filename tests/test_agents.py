"""Agents (data.agent) and the OpenAI-compatible endpoint, with the real `openai` client.

First the endpoint alone, with a scripted sampler (no model, fast): exact ids and logprobs in
the responses, token-in/token-out continuation of a chat (the reply ids are the template's, the
model's ids are never re-tokenised), tool calls parsed back, the split rule when the agent
rewrites its history, the budget cut, 32 concurrent clients served as one sampler batch, bad
requests and a missing key answered with OpenAI's error JSON. Then the engine with a real tiny
model and agents in the contained child process: the trainer's forward reproduces every
recorded logprob, the loss mask is exactly the model's ids, a rewriting agent's rollout splits,
a raising and a hanging agent are counted (heavy: each compiles the sampler)."""

import asyncio
import pathlib
import textwrap
import threading

import jax
import numpy as np
import openai
import pytest
from conftest import assert_agent_batch_is_the_trainers, importable_modules
from flax import nnx
from transformers import AutoTokenizer

from jgrpo.config import ConfigError, load_config
from jgrpo.models import from_pretrained
from jgrpo.models.tiny import build_tiny_model
from jgrpo.rollout import build_engine
from jgrpo.rollout.agent_record import Settings
from jgrpo.rollout.conversation import ChatFormat
from jgrpo.rollout.endpoint import Endpoint
from jgrpo.sampling import Generation


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return AutoTokenizer.from_pretrained(
        build_tiny_model(tmp_path_factory.mktemp("tok") / "m", chat=True)
    )


class Script:
    """A stand-in sampler: the text of a row is `reply(prompt text)`; its logprobs are
    -0.01 * (1 + position) - 0.001 * row id, so every id's logprob is known exactly."""

    def __init__(self, tok, reply):
        self.tok, self.reply, self.calls = tok, reply, []

    def __call__(self, prompts, max_new, top_p, row_ids):
        self.calls.append(dict(rows=len(prompts), max_new=max_new, top_p=top_p))
        b = len(prompts)
        tokens = np.zeros((b, max_new), np.int32)
        logprobs = np.zeros((b, max_new), np.float32)
        lengths = np.zeros(b, np.int32)
        truncated = np.zeros(b, bool)
        for i, (p, r) in enumerate(zip(prompts, row_ids)):
            ids = self.tok(self.reply(self.tok.decode(p)), add_special_tokens=False)["input_ids"]
            keep = min(len(ids), max_new)
            tokens[i, :keep] = ids[:keep]
            logprobs[i, :keep] = expected_logprobs(keep, r)
            lengths[i] = keep
            truncated[i] = keep < len(ids) or ids[keep - 1] != 261
        return Generation(
            tokens=tokens,
            logprobs=logprobs,
            filtered_logprobs=logprobs,
            lengths=lengths,
            truncated=truncated,
            prompt_tokens=np.zeros((b, 1), np.int32),
            prompt_lengths=np.ones(b, np.int32),
            num_decode_steps=max_new,
        )


def expected_logprobs(n, row_id):
    return (-0.01 * (1 + np.arange(n)) - 0.001 * row_id).astype(np.float32)


SETTINGS = Settings(budget=200, max_calls=4, temperature=1.0, top_p=1.0)


def serve(endpoint, generate, agents, running=None, expect_errors=False, max_retries=2):
    """Run the coroutines `agents` (each given its rollout's client) on a client thread while
    this thread serves the endpoint; their results, in order. `max_retries`: the clients'
    (openai's default; data.agent's clients have 0)."""
    ids = endpoint.open(list(range(len(agents))), SETTINGS)
    out = {}

    def clients():
        async def one(agent, rid):
            url = endpoint.base_url(rid)
            key, retries = endpoint.api_key, max_retries
            async with openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=retries) as client:
                return await agent(client)

        async def main():
            runs = (one(agent, rid) for agent, rid in zip(agents, ids))
            return await asyncio.gather(*runs, return_exceptions=True)

        out["results"] = asyncio.run(main())

    thread = threading.Thread(target=clients)
    thread.start()
    while thread.is_alive():
        endpoint.step(generate, len(agents) if running is None else running)
    out["rollouts"] = endpoint.close_rollouts(ids)
    for r in out["results"]:
        if isinstance(r, openai.APIError) and not expect_errors:
            raise AssertionError(f"the agent got {r.body}")
    return out


@pytest.fixture(scope="module")
def endpoint(tok):
    e = Endpoint(tok, ChatFormat(tok, [tok.eos_token_id]).stop_ids, gather_s=0.5)
    e.start()
    yield e
    e.close()


USER = [{"role": "user", "content": "hi"}]


def test_a_chat_continues_token_in_token_out(endpoint, tok):
    """Call 2's prompt ids are call 1's prompt + completion ids + the template's reply ids
    (one sequence, mask on the model's ids); the responses carry the exact ids and logprobs."""
    # the model writes `{"a":1}` unspaced: the template would render `{"a": 1}`, other ids
    call = '<tool_call>\n{"name": "add", "arguments": {"a":1}}\n</tool_call><|im_end|>'
    script = Script(tok, lambda p: call if "<tool_response>" not in p else "2<|im_end|>")
    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add.",
                "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
            },
        }
    ]

    async def agent(client):
        messages = list(USER)
        first = await client.chat.completions.create(
            model="m", messages=messages, tools=tools, logprobs=True
        )
        message = first.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        tool_call = message.tool_calls[0]
        messages.append({"role": "tool", "tool_call_id": tool_call.id, "content": "2"})
        second = await client.chat.completions.create(model="m", messages=messages, tools=tools)
        return first, second

    out = serve(endpoint, script, [agent])
    first, second = out["results"][0]
    assert first.choices[0].finish_reason == "tool_calls"
    call_ids = tok(call, add_special_tokens=False)["input_ids"]
    assert first.choices[0].token_ids == call_ids
    assert [c.logprob for c in first.choices[0].logprobs.content] == pytest.approx(
        expected_logprobs(len(call_ids), 0 * 4096).tolist()
    )
    tc = first.choices[0].message.tool_calls[0]
    assert (tc.function.name, tc.function.arguments) == ("add", '{"a": 1}')
    chat = ChatFormat(tok, [tok.eos_token_id], tools)
    reply = chat.reply_ids([{"role": "tool", "content": "2"}])
    assert second.prompt_token_ids == first.prompt_token_ids + call_ids + reply
    assert first.prompt_token_ids == chat.prompt_ids(USER)
    assert second.choices[0].message.content == "2" and second.choices[0].finish_reason == "stop"
    (rollout,) = out["rollouts"]
    (seq,) = rollout.sequences
    assert seq.prompt == first.prompt_token_ids
    answer = second.choices[0].token_ids
    assert seq.region == call_ids + reply + answer
    assert seq.generated == [True] * len(call_ids) + [False] * len(reply) + [True] * len(answer)
    want = [*expected_logprobs(len(call_ids), 0), *[0.0] * len(reply)]
    want += list(expected_logprobs(len(answer), 16))  # call 1's row id: row 0, call 1, choice 0
    np.testing.assert_array_equal(np.float32(seq.logprobs), np.float32(want))


def test_a_rewritten_history_starts_a_new_sequence(endpoint, tok):
    script = Script(tok, lambda p: "ok<|im_end|>")

    async def agent(client):
        one = await client.chat.completions.create(model="m", messages=USER)
        summary = [{"role": "user", "content": "summary: hi, ok. Go on."}]
        two = await client.chat.completions.create(model="m", messages=summary)
        follow = summary + [{"role": "assistant", "content": "ok"}, USER[0]]
        three = await client.chat.completions.create(model="m", messages=follow)
        return one, two, three

    out = serve(endpoint, script, [agent])
    one, two, three = out["results"][0]
    (rollout,) = out["rollouts"]
    assert [s.prompt for s in rollout.sequences] == [one.prompt_token_ids, two.prompt_token_ids]
    assert three.prompt_token_ids[: len(rollout.sequences[1].prompt)] == two.prompt_token_ids
    assert len(rollout.sequences[1].region) == len(three.prompt_token_ids) - len(
        two.prompt_token_ids
    ) + len(three.choices[0].token_ids)


def test_completions_take_ids_and_stop_strings_and_n(endpoint, tok):
    script = Script(tok, lambda p: "abc. def<|im_end|>")

    async def agent(client):
        ids = tok("Q:", add_special_tokens=False)["input_ids"]
        return await client.completions.create(model="m", prompt=ids, stop=["."], n=3)

    out = serve(endpoint, script, [agent])
    r = out["results"][0]
    assert [c.text for c in r.choices] == ["abc"] * 3
    assert r.choices[0].token_ids == tok("abc.", add_special_tokens=False)["input_ids"]
    assert r.choices[0].prompt_token_ids == tok("Q:", add_special_tokens=False)["input_ids"]
    assert r.choices[2].logprobs.token_logprobs == pytest.approx(expected_logprobs(4, 2).tolist())
    assert script.calls[-1]["rows"] == 3  # the n choices are rows of one sampler batch


def test_a_request_over_the_budget_is_cut_and_flagged(endpoint, tok):
    script = Script(tok, lambda p: "y" * 300 + "<|im_end|>")

    async def agent(client):
        first = await client.chat.completions.create(model="m", messages=USER, max_tokens=500)
        messages = USER + [{"role": "assistant", "content": first.choices[0].message.content}]
        try:  # the history extends the sequence, whose budget is used up
            await client.chat.completions.create(model="m", messages=messages + USER)
        except openai.BadRequestError as e:
            return first, e.body

    out = serve(endpoint, script, [agent])
    first, error = out["results"][0]
    assert first.jgrpo["budget_cut"] and first.choices[0].finish_reason == "length"
    assert len(first.choices[0].token_ids) == SETTINGS.budget
    assert error["code"] == "budget_exhausted"
    assert out["rollouts"][0].budget_cuts == 1 and out["rollouts"][0].bad_requests == 1


@pytest.mark.heavy  # 32 clients and their threads: seconds on a loaded machine
def test_concurrent_agents_are_batched(tok):
    """32 agents, 2 calls each: every call of a round is one sampler batch of 32 rows (a
    batch runs once every running rollout has a request queued; gather_s is long here)."""
    endpoint = Endpoint(tok, ChatFormat(tok, [tok.eos_token_id]).stop_ids, gather_s=60)
    script = Script(tok, lambda p: "ok<|im_end|>")

    async def agent(client):
        one = await client.chat.completions.create(model="m", messages=USER)
        messages = USER + [one.choices[0].message.model_dump(exclude_none=True), USER[0]]
        return await client.chat.completions.create(model="m", messages=messages)

    out = serve(endpoint, script, [agent] * 32)
    assert all(not isinstance(r, Exception) for r in out["results"])
    assert endpoint.batch_sizes == [32, 32]
    assert all(len(r.sequences) == 1 for r in out["rollouts"])
    endpoint.close()


@pytest.mark.heavy  # 256 clients and their threads
def test_a_burst_of_agents_connects_at_once(tok):
    """256 agents connect at once, without retries (as data.agent's clients): none is refused
    (the stdlib server's listen backlog of 5 reset about half of such a burst)."""
    endpoint = Endpoint(tok, ChatFormat(tok, [tok.eos_token_id]).stop_ids, gather_s=60)
    script = Script(tok, lambda p: "ok<|im_end|>")

    async def agent(client):
        return await client.chat.completions.create(model="m", messages=USER)

    out = serve(endpoint, script, [agent] * 256, max_retries=0)
    assert [type(r).__name__ for r in out["results"] if isinstance(r, Exception)] == []
    assert endpoint.batch_sizes == [256]
    endpoint.close()


def test_bad_requests_get_openai_errors(endpoint, tok):
    script = Script(tok, lambda p: "ok<|im_end|>")
    cases = [
        dict(messages=[]),
        dict(messages=[{"role": "robot", "content": "x"}]),
        dict(messages=USER, temperature=0.5),
        dict(messages=USER, top_p=0),
        dict(messages=USER, n=0),
        dict(messages=USER, stream=True),
        dict(messages=USER, tool_choice="required"),
        dict(messages=USER, extra_body={"frequency_penalty_x": 1}),
        dict(messages=USER, max_tokens=0),
    ]

    async def agent(client):
        caught = []
        for case in cases:
            try:
                await client.chat.completions.create(model="m", **case)
                caught.append(None)
            except openai.BadRequestError as e:
                caught.append(e.body)
        return caught

    out = serve(endpoint, script, [agent])
    errors = out["results"][0]
    assert all(e is not None and e["type"] == "invalid_request_error" for e in errors), errors
    assert [e["param"] for e in errors[:5]] == [
        "messages",
        "messages[0]",
        "temperature",
        "top_p",
        "n",
    ]
    assert out["rollouts"][0].bad_requests == len(cases) and not script.calls


def test_a_missing_or_wrong_key_is_refused(endpoint):
    import json
    import urllib.error
    import urllib.request

    (rid,) = endpoint.open([0], SETTINGS)
    url = endpoint.base_url(rid) + "/chat/completions"
    for headers in ({}, {"Authorization": "Bearer nope"}):
        request = urllib.request.Request(url, data=b"{}", headers=headers, method="POST")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(request, timeout=10)
        assert e.value.code == 401
        assert json.loads(e.value.read())["error"]["code"] == "invalid_api_key"
    good = {"Authorization": f"Bearer {endpoint.api_key}"}
    for path, code in (("/nothing", 404), ("/chat/completions", 400)):
        request = urllib.request.Request(
            endpoint.base_url(rid) + path, data=b"[1", headers=good, method="POST"
        )
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(request, timeout=10)
        assert e.value.code == code
    models = urllib.request.urlopen(
        urllib.request.Request(endpoint.base_url(rid) + "/models", headers=good), timeout=10
    )
    assert json.loads(models.read())["data"][0]["id"] == "jgrpo-policy"
    endpoint.close_rollouts([rid])


def test_an_agent_config_is_checked():
    with pytest.raises(ConfigError, match="data.agent: 'nocolon' must look like module:function"):
        load_config(None, ["data.agent=nocolon"])
    with pytest.raises(ConfigError, match="data.agent: an agent runs its own tools"):
        load_config(None, ["data.agent=a:b", "data.tools=[a:c]"])


# ----------------------------------------------------------------------------- real model

AGENTS = textwrap.dedent(
    """
    import asyncio, time

    async def talk(client, record):
        '''Two calls continuing one conversation, then a rewritten one (a new sequence).'''
        messages = list(record["prompt_messages"])
        first = await client.chat.completions.create(model="policy", messages=messages)
        messages.append({"role": "assistant", "content": first.choices[0].message.content})
        messages.append({"role": "user", "content": "again"})
        second = await client.chat.completions.create(model="policy", messages=messages)
        if record["id"].endswith("1"):
            short = [{"role": "user", "content": "start over"}]
            await client.chat.completions.create(model="policy", messages=short)
        return float(len(second.choices[0].token_ids) % 3)

    async def once(client, record):
        await client.chat.completions.create(model="policy", messages=record["prompt_messages"])
        return 0.0

    async def broken(client, record):
        await client.chat.completions.create(model="policy", messages=record["prompt_messages"])
        if record["id"].endswith("1"):
            raise ValueError("the agent's own bug")
        if record["id"].endswith("0"):
            time.sleep(120)  # blocks the event loop: its process is killed
        if record["id"].endswith("3"):
            await asyncio.sleep(120)  # waits: cancelled
        return 1.0

    def not_async(client, record):
        return 1.0
    """
)


@pytest.fixture(scope="module")
def agent_module(tmp_path_factory):
    for _ in importable_modules(tmp_path_factory, {"jgrpo_test_agents": AGENTS}):
        yield "jgrpo_test_agents"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    from test_multiturn import focused_model

    return focused_model(tmp_path_factory.mktemp("agent_model") / "m")


def agent_engine(folder, agent, *overrides):
    cfg = load_config(
        None,
        [
            f"model.path={folder}",
            "grpo.num_prompts_per_step=2",
            "grpo.num_generations_per_prompt=4",
            "data.task=prompts",
            f"data.agent={agent}",
            "data.tool_processes=2",
            "rollout.max_new_tokens=64",
            "rollout.prompt_bucket=32",
            "rollout.max_turns=4",
            "data.reward_functions=[]",
            *overrides,
        ],
    )
    engine, graphdef = build_engine(cfg, folder)
    engine.task.agent_runner.start()
    params = nnx.state(from_pretrained(folder))
    examples = [
        {"task": "prompts", "row": {"prompt": p, "id": f"r{i}"}, "id": f"train/{i}"}
        for i, p in enumerate(["hi", "yo"])
    ]
    return cfg, engine, graphdef, params, examples


@pytest.mark.heavy
def test_agent_rollouts_train_on_exactly_the_sampled_tokens(chat_model, agent_module):
    cfg, engine, graphdef, params, examples = agent_engine(chat_model, f"{agent_module}:talk")
    try:
        result = engine.rollout(graphdef, params, examples, jax.random.key(0), 0, 4)
        val = engine.rollout(graphdef, params, examples, jax.random.key(1), 0, 4, training=False)
    finally:
        engine.task.close()
    assert len(val.batch["group_ids"]) == 8  # evaluation: one row per rollout
    batch = result.step_batch()
    rollouts = result.agent_rollouts
    assert [len(r.sequences) for r in rollouts] == [1] * 4 + [2] * 4  # record r1 rewrites
    assert result.stats["agents/split_rollouts"] == 4 and result.stats["agents/sequences"] == 12
    assert batch.input_ids.shape[0] == 16  # 12 sequences, padded to a multiple of 8 rollouts
    assert (np.asarray(batch.group_ids)[12:] == -1).all()
    sizes = result.sampler_batch_sizes  # rows of each sampler call: the 20 calls, batched
    assert sum(sizes) == result.stats["agents/calls"] == 20 and max(sizes) > 1
    assert_agent_batch_is_the_trainers(graphdef, params, result, cfg.rollout)
    owners = [b for b, r in enumerate(rollouts) for _ in r.sequences]
    rewards = np.asarray(batch.rewards)[: len(owners)]
    for b in range(len(rollouts)):  # every sequence of a rollout carries its reward
        assert len(set(rewards[np.asarray(owners) == b].tolist())) == 1


@pytest.mark.heavy
def test_a_raising_and_a_hanging_agent_are_counted(chat_model, agent_module, capsys):
    from jgrpo.tasks.child import forget_reports, report_failures

    cfg, engine, graphdef, params, examples = agent_engine(
        chat_model, f"{agent_module}:broken", "data.agent_timeout_s=15", "data.tool_processes=4"
    )  # a process per row: the hanging agent blocks its own process only
    examples += [
        {"task": "prompts", "row": {"prompt": p, "id": f"r{i}"}, "id": f"train/{i}"}
        for i, p in ((2, "ok"), (3, "so"))
    ]
    try:  # the timeout counts the agent's own time, not its calls' (compiles included)
        result = engine.rollout(graphdef, params, examples, jax.random.key(0), 0, 1)
    finally:
        engine.task.close()
    assert (result.stats["agents/errors"], result.stats["agents/timeouts"]) == (1, 2), result.stats
    assert np.asarray(result.batch["group_ids"]).tolist() == [-1, -1, 2, -1]
    forget_reports()
    report_failures(result.failures)
    err = capsys.readouterr().err
    assert err.count("ValueError: the agent's own bug") == 1 and "jgrpo_test_agents.py" in err


@pytest.mark.heavy  # starts a child process
def test_an_agent_that_is_not_async_is_refused(agent_module):
    from jgrpo.tasks.agents import AgentRunner

    runner = AgentRunner(f"{agent_module}:not_async", 5, 30)
    with pytest.raises(ConfigError, match="data.agent: .* must be an `async def agent"):
        runner.start()
    runner.close()


def test_padding_rows_stay_padding_when_batches_join():
    """Worker and pod joins shift group ids but leave padding rows (-1) alone; a pod host's
    agent batch is padded with rows that hold no sample."""
    from jgrpo.rollout.agent_rollout import pad_rows
    from jgrpo.rollout.results import shift_groups

    assert shift_groups(np.asarray([0, 1, -1]), 4).tolist() == [4, 5, -1]
    batch = {
        "group_ids": np.asarray([0, -1], np.int32),
        "input_ids": np.ones((2, 3), np.int32),
        "reward_terms": np.zeros((2, 1), np.float32),
        "weight_version": np.asarray([7, 7], np.int32),
    }
    padded = pad_rows(batch, 4)
    assert padded["group_ids"].tolist() == [0, -1, -1, -1]
    assert padded["input_ids"][2:].sum() == 0 and np.isnan(padded["reward_terms"][2:]).all()
    assert padded["weight_version"].tolist() == [7] * 4


def _agent_result(first_row, sample_mask, correct, sizes):
    """A worker's agent batch (rows: a rollout's first row = 1) with its endpoint stats."""
    from jgrpo.rollout.agent_rollout import AGENT_COUNTS
    from jgrpo.rollout.results import RolloutResult, batch_stats

    r = len(first_row)
    batch = {k: np.asarray(first_row, np.int32) for k in AGENT_COUNTS}
    batch |= {
        "agent_first_row": np.asarray(first_row, np.int32),
        "sample_mask": np.asarray(sample_mask, np.float32),
        "correct": np.asarray(correct, bool),
        "group_ids": np.where(np.asarray(sample_mask) > 0, 0, -1).astype(np.int32),
        "rewards": np.zeros(r, np.float32),
        "lengths": np.ones(r, np.int32),
        "truncated": np.zeros(r, bool),
        "weight_version": np.zeros(r, np.int32),
        "input_ids": np.ones((r, 2), np.int32),
    }
    stats = batch_stats(batch) | {
        "reward/num_errors": 0.0,
        "reward/num_timeouts": 0.0,
        "reward/num_none": 0.0,
        "agents/sampler_calls": float(len(sizes)),
        "agents/sampler_batch_mean": float(np.mean(sizes)),
        "agents/sampler_batch_max": float(max(sizes)),
        "perf/agent_s": float(len(sizes)),
    }
    return RolloutResult(batch, stats, [], ())


def test_agent_batch_stats_count_rollouts_and_join_the_endpoints():
    """reward/num_masked and reward/accuracy count rollouts (a rollout's first row), not
    padding rows or a split rollout's second row; joined workers sum their sampler calls and
    average their batch sizes over every call (hand values)."""
    from jgrpo.rollout.results import concat_results

    # worker 0: rollout A split in 2 (correct), rollout B failed (masked), 2 padding rows
    a = _agent_result([1, 0, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [4, 2])
    # worker 1: rollouts C (wrong), D (correct), no padding
    b = _agent_result([1, 1], [1, 1], [0, 1], [8])
    assert a.stats["reward/num_masked"] == 1.0 and a.stats["reward/accuracy"] == 0.5
    joined = concat_results([a, b], [0, 1]).stats
    assert joined["reward/num_masked"] == 1.0 and joined["reward/accuracy"] == 0.5
    assert joined["agents/sampler_calls"] == 3.0
    assert joined["agents/sampler_batch_mean"] == (4 + 2 + 8) / 3
    assert joined["agents/sampler_batch_max"] == 8.0 and joined["perf/agent_s"] == 2.0


@pytest.mark.heavy
def test_grpo_trainer_trains_with_an_agent_function(chat_model, tmp_path):
    """GRPOTrainer(agent=fn) (cloudpickled into the child): two steps through train.run; the
    train step's forward reproduces the endpoint's logprobs."""
    import jgrpo
    from jgrpo.metrics import read_metrics

    async def agent(client, record):
        messages = list(record["prompt_messages"])
        first = await client.chat.completions.create(model="p", messages=messages, max_tokens=16)
        messages += [first.choices[0].message.model_dump(exclude_none=True)]
        messages += [{"role": "user", "content": "more"}]
        second = await client.chat.completions.create(model="p", messages=messages, max_tokens=16)
        return float(len(second.choices[0].token_ids) % 2)

    trainer = jgrpo.GRPOTrainer(
        None,
        agent=agent,
        run_dir=tmp_path / "run",
        train_dataset=[{"prompt": "hi"}, {"prompt": "yo"}, {"prompt": "so"}],
        overrides=[
            f"model.path={chat_model}",
            "grpo.num_prompts_per_step=2",
            "grpo.num_generations_per_prompt=4",
            "grpo.max_num_steps=2",
            "rollout.max_new_tokens=64",
            "rollout.prompt_bucket=32",
            "rollout.max_turns=3",
            "data.tool_processes=1",
        ],
    )
    trainer.train()
    rows = [r for r in read_metrics(tmp_path / "run") if r["step"] > 0]
    assert len(rows) == 2
    for r in rows:
        assert r["agents/calls"] == 16 and r["agents/errors"] == 0
        assert 1.0 <= r["logprob/token_mult_prob_error"] <= 1.001
        assert r["agents/sampler_batch_max"] > 1


FENCE = "`" * 3


def test_the_demo_agent_is_the_documented_one_and_imports_no_jgrpo():
    """configs/calculator_agent.py (`make demo-agent`) is docs/agents.md's agent, word for word;
    it imports nothing from jgrpo; its tool schema is the built-in calculator's (so its prompts
    are the tool demo's ids)."""
    import ast
    import importlib.util

    from transformers.utils import get_json_schema

    from jgrpo.tasks.calculator import calculator

    root = pathlib.Path(__file__).resolve().parents[1]
    path = root / "configs" / "calculator_agent.py"
    source = path.read_text()
    page = (root / "docs" / "agents.md").read_text()
    assert f"{FENCE}python\n# calculator_agent.py\n{source}{FENCE}" in page
    tree = ast.parse(source)
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert imported and not any(m.split(".")[0] == "jgrpo" for m in imported)
    spec = importlib.util.spec_from_file_location("calculator_agent", path)
    agent = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(agent)
    assert agent.TOOLS == [get_json_schema(calculator)]
    assert agent.calculate("347*829") == calculator("347*829") == "287663"
    assert agent.calculate("7/3") == calculator("7/3")
