"""Multi-turn rollouts (jgrpo.rollout.turns through RolloutEngine): the turn loop's budget,
replies and counts with a scripted sampler; then a real tiny model talking to an environment:
the trainer's forward reproduces the sampler's logprobs on every generated token of every turn,
the loss mask is exactly the generated ids, a rollout split into parts (as Ray workers run it)
equals the whole, one turn is the single-turn rollout bit for bit, and the compiles stay
bounded. Full-size runs through `train.run` (local vs Ray, resume, LoRA) are `heavy`."""

import dataclasses
import functools
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
import safetensors.numpy
from conftest import importable_modules
from flax import nnx
from transformers import AutoTokenizer

from jgrpo import sampling, sharding, step, step_setup, train
from jgrpo.config import load_config
from jgrpo.metrics import read_metrics
from jgrpo.models import from_pretrained
from jgrpo.models.tiny import build_tiny_model
from jgrpo.rollout import build_engine, concat_results
from jgrpo.rollout.conversation import ChatFormat
from jgrpo.rollout.turns import TurnSettings, run_turns
from jgrpo.tasks.child import ERROR, OK, TIMEOUT

ENV_MODULE = textwrap.dedent(
    """
    class Echo:
        '''Never done: answers every turn with its step count (the budget ends it).'''

        def reset(self, **record):
            self.turn = 0
            return None

        def step(self, text):
            self.turn += 1
            return f"step {self.turn}", 0.5, False
    """
)


@pytest.fixture(scope="module")
def env_module(tmp_path_factory):
    for _ in importable_modules(tmp_path_factory, {"jgrpo_test_envs": ENV_MODULE}):
        yield "jgrpo_test_envs"


# ----------------------------------------------------------------------------- scripted sampler


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return AutoTokenizer.from_pretrained(
        build_tiny_model(tmp_path_factory.mktemp("tok") / "m", chat=True)
    )


class Script:
    """A stand-in for sampling.generate: global row r's turn t emits texts[(r, t)] (default
    texts[t], else "x<|im_end|>"); records the calls."""

    def __init__(self, tok, texts, logprob=-0.5):
        self.tok, self.texts, self.logprob, self.calls = tok, texts, logprob, []

    def __call__(self, model, prompts, params, key, first_row=0, group_size=1, row_ids=None):
        turn = len(self.calls) + 1
        rows = row_ids if row_ids is not None else list(range(first_row, first_row + len(prompts)))
        self.calls.append(dict(rows=list(rows), prompts=[list(p) for p in prompts], params=params))
        n = params.max_new_tokens
        b = len(prompts)
        tokens = np.zeros((b, n), np.int32)
        lengths = np.zeros(b, np.int32)
        truncated = np.zeros(b, bool)
        for i, row in enumerate(rows):
            text = self.texts.get((row, turn), self.texts.get(turn, "x<|im_end|>"))
            ids = self.tok(text, add_special_tokens=False)["input_ids"]
            lengths[i] = min(len(ids), n)
            tokens[i, : lengths[i]] = ids[:n]
            truncated[i] = len(ids) > n or ids[-1] not in params.stop_token_ids
        width = -(-max(map(len, prompts)) // params.prompt_bucket) * params.prompt_bucket
        prompt_tokens = np.zeros((b, width), np.int32)
        for i, p in enumerate(prompts):
            prompt_tokens[i, width - len(p) :] = p
        mask = np.arange(n)[None] < lengths[:, None]
        return sampling.Generation(
            tokens=tokens,
            logprobs=np.where(mask, self.logprob, 0.0).astype(np.float32),
            filtered_logprobs=np.zeros((b, n), np.float32),
            lengths=lengths,
            truncated=truncated,
            prompt_tokens=prompt_tokens,
            prompt_lengths=np.asarray([len(p) for p in prompts], np.int32),
            num_decode_steps=int(lengths.max()) - 1,
        )


class FakeRunner:
    """Answers tool calls with `answer(name, arguments)` and environment steps with
    `step(row, text)`; records the ops."""

    def __init__(self, answer=None, step=None):
        self.answer, self.step, self.ops = answer, step, []

    def run(self, ops):
        self.ops.append(list(ops))
        return [
            self.answer(*arg) if kind == "call" else self.step(row, arg) for kind, row, arg in ops
        ]


CALL = (  # a whole turn: one hermes call, then the stop token
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call><|im_end|>'
)


def run_script(monkeypatch, tok, texts, settings, n=64, runner=None, prompts=None, env_ok=None):
    script = Script(tok, texts)
    monkeypatch.setattr(sampling, "generate", script)
    prompts = prompts or [
        tok("<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    ]
    params = sampling.SamplingParams(max_new_tokens=n, prompt_bucket=16)
    chat = ChatFormat(tok, [tok.eos_token_id])
    conv = run_turns(
        None,
        prompts,
        params,
        jax.random.key(0),
        settings,
        tok,
        first_row=4,
        chat=chat,
        runner=runner,
        environment_ok=env_ok,
    )
    return conv, script, chat


def region_text(tok, conv, b=0):
    return tok.decode(conv.tokens[b, : conv.lengths[b]])


def test_tool_calls_run_and_their_replies_join_the_row(monkeypatch, tok):
    settings = TurnSettings(max_turns=3, max_tool_response_tokens=4, tools=True)
    runner = FakeRunner(answer=lambda name, args: (OK, "12345678") if args else (TIMEOUT, "t/o"))
    texts = {1: CALL % "3*4", 2: "12<|im_end|>"}
    conv, script, chat = run_script(monkeypatch, tok, texts, settings, n=160, runner=runner)
    reply = chat.reply_ids([{"role": "tool", "name": "calculator", "content": "1234"}])
    gen1 = tok(CALL % "3*4")["input_ids"]
    gen2 = tok("12<|im_end|>")["input_ids"]
    assert conv.tokens[0, : conv.lengths[0]].tolist() == gen1 + reply + gen2  # the cut reply
    assert conv.generated[0, : conv.lengths[0]].tolist() == [1] * len(gen1) + [0] * len(reply) + [
        1
    ] * len(gen2)
    assert (conv.logprobs[0][conv.generated[0]] == -0.5).all()
    assert (conv.logprobs[0][~conv.generated[0]] == 0).all()
    assert runner.ops == [[("call", 0, ("calculator", {"expression": "3*4"}))]]
    # turn 2 re-prefills the whole conversation, keyed by the row's global index
    assert script.calls[1]["prompts"][0][-len(reply) - len(gen1) :] == gen1 + reply
    assert script.calls[1]["rows"] == [4]
    assert conv.texts == ["12"] and not conv.truncated[0]
    assert [m["role"] for m in conv.messages[0]] == ["assistant", "tool", "assistant"]
    assert conv.messages[0][1]["content"] == "1234"
    counts = {k: int(v[0]) for k, v in conv.counts.items()}
    assert counts["turns"] == 2 and counts["tool_calls"] == 1 and counts["tool_errors"] == 0
    assert counts["tool_responses_cut"] == 1 and counts["reply_tokens"] == len(reply)


def test_tool_message_i_answers_call_i_when_a_malformed_call_sits_between(monkeypatch, tok):
    """A turn mixing valid calls with a malformed one: each answer stays at its call's place
    (the error is not moved first, where the model would read it as `lookup`'s answer)."""
    settings = TurnSettings(max_turns=2, tools=True)
    runner = FakeRunner(answer=lambda name, args: (OK, f"{name}={args['key']}"))
    calls = [
        '<tool_call>{"name": "lookup", "arguments": {"key": "a"}}</tool_call>',
        "<tool_call>{oops</tool_call>",
        '<tool_call>{"name": "fetch", "arguments": {"key": "b"}}</tool_call>',
    ]
    texts = {1: "".join(calls) + "<|im_end|>", 2: "done<|im_end|>"}
    conv, _, chat = run_script(monkeypatch, tok, texts, settings, n=256, runner=runner)
    tools = conv.messages[0][1:4]
    assert [(m["name"], m["content"][:6]) for m in tools] == [
        ("lookup", "lookup"),
        ("", "error:"),
        ("fetch", "fetch="),
    ]
    assert tools[1]["content"].startswith("error: the tool call is not valid JSON")
    assert [m["role"] for m in conv.messages[0]] == [
        "assistant",
        "tool",
        "tool",
        "tool",
        "assistant",
    ]
    gen1 = tok(texts[1])["input_ids"]
    reply = chat.reply_ids(tools)
    assert conv.tokens[0, len(gen1) : len(gen1) + len(reply)].tolist() == reply
    assert conv.counts["tool_calls"][0] == 3 and conv.counts["tool_errors"][0] == 1


def test_a_base_models_turn_ends_at_the_templates_end_token(monkeypatch, tmp_path):
    """EOS <eos> (as a Qwen2.5 base model's <|endoftext|>), turns end with <|im_end|>: the
    sampler stops a turn at <|im_end|> too, and the conversation goes on."""
    from test_conversation import base_model_folder

    base = AutoTokenizer.from_pretrained(base_model_folder(tmp_path / "base"))
    im_end = base.convert_tokens_to_ids("<|im_end|>")
    runner = FakeRunner(answer=lambda name, args: (OK, "12"))
    settings = TurnSettings(max_turns=2, tools=True)
    texts = {1: CALL % "3*4", 2: "12<|im_end|>"}
    conv, script, _ = run_script(monkeypatch, base, texts, settings, n=160, runner=runner)
    assert [c["params"].stop_token_ids for c in script.calls] == [(1, im_end)] * 2
    assert conv.counts["turns"][0] == 2 and not conv.truncated[0] and conv.texts == ["12"]


def test_an_environment_that_never_says_done_is_ended_by_the_budget(monkeypatch, tok):
    settings = TurnSettings(max_turns=50, environment=True)
    runner = FakeRunner(step=lambda row, text: (OK, ("again", 1.0, False)))
    n = 64
    conv, script, chat = run_script(
        monkeypatch, tok, {}, settings, n=n, runner=runner, env_ok=np.ones(1, bool)
    )
    gen = tok("x<|im_end|>")["input_ids"]
    reply = chat.reply_ids([{"role": "user", "content": "again"}])
    turns = 1 + (n - len(gen)) // (len(gen) + len(reply))  # whole turns that fit
    assert conv.truncated[0] and conv.counts["turns"][0] == turns
    assert conv.environment_rewards[0] == turns  # every completed step's reward
    used = conv.lengths[0]
    assert used + len(reply) >= n  # the next reply would leave no room for a generated token
    assert conv.generated[0, :used].sum() == turns * len(gen)
    # each turn's budget is what is left, rounded up to prompt_bucket
    assert [c["params"].max_new_tokens for c in script.calls[1:]] == [
        min(n, -(-(n - k * (len(gen) + len(reply))) // 16) * 16) for k in range(1, turns)
    ]


def test_max_turns_end_a_row_and_failures_are_counted(monkeypatch, tok):
    settings = TurnSettings(max_turns=2, tools=True, environment=True)
    runner = FakeRunner(
        answer=lambda name, args: (ERROR, "error: boom"),
        step=lambda row, text: (OK, ("obs", None, False)) if row == 1 else (TIMEOUT, "t/o"),
    )
    texts = {(4, 1): CALL % "1", (5, 1): "a<|im_end|>", (6, 1): "b<|im_end|>", 2: CALL % "2"}
    prompt = tok("<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    conv, script, _ = run_script(
        monkeypatch,
        tok,
        texts,
        settings,
        n=256,
        runner=runner,
        prompts=[prompt] * 3,
        env_ok=np.asarray([True, True, True]),
    )
    # row 0: a failing call then a call at the last turn (not run); row 1: an observation, then
    # a call at the last turn; row 2: its environment step timed out (the row ends)
    assert conv.counts["turns"].tolist() == [2, 2, 1]
    assert conv.counts["tool_calls"].tolist() == [2, 1, 0]
    assert conv.counts["tool_errors"].tolist() == [1, 0, 0]
    assert conv.counts["environment_errors"].tolist() == [0, 0, 1]
    assert conv.counts["environment_timeouts"].tolist() == [0, 0, 1]
    assert not conv.truncated.any()
    assert script.calls[1]["rows"] == [4, 5]  # turn 2: rows 0 and 1 (global 4, 5), no padding
    assert np.isnan(conv.environment_rewards).all()
    assert conv.messages[0][1] == {"role": "tool", "name": "calculator", "content": "error: boom"}


# ----------------------------------------------------------------------------- a real model


def focused_model(folder):
    """The tiny chat model (d 32, 1 layer, untied) made to emit mostly <|im_end|>, the tool
    tags, `x` and `{`: a constant input direction (embedding column 0) that the head turns into
    +4 for those tokens and -4 for the rest, so turns end within a few tokens."""
    build_tiny_model(
        folder,
        chat=True,
        tie_word_embeddings=False,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,  # compiles in about half the time of 2
        max_position_embeddings=512,
    )
    w = safetensors.numpy.load_file(str(folder / "model.safetensors"))
    keep = np.zeros(w["lm_head.weight"].shape[0], bool)
    keep[[261, 262, 263, 4 + ord("x"), 4 + ord("{")]] = True
    w["model.embed_tokens.weight"][:, 0] = 3.0
    w["lm_head.weight"][:, 0] = np.where(keep, 4.0, -4.0)
    safetensors.numpy.save_file(w, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


P, G = 2, 4
SHORT = (  # two turns sharing one compiled program: same rows, context width and budget
    "data.task=prompts",
    "rollout.max_new_tokens=64",
    "rollout.prompt_bucket=64",
    "rollout.max_turns=2",
)
LONG = (
    "data.task=arithmetic",
    "data.max_operand=9",
    "rollout.max_new_tokens=96",
    "rollout.prompt_bucket=16",
    "rollout.max_turns=4",
)


def engine_cfg(folder, *overrides):
    return load_config(
        None,
        [
            f"model.path={folder}",
            f"grpo.num_prompts_per_step={P}",
            f"grpo.num_generations_per_prompt={G}",
            "data.tool_processes=1",
            *overrides,
        ],
    )


def examples_for(cfg):
    if cfg.data.task == "prompts":
        return [
            {"task": "prompts", "row": {"prompt": p}, "id": f"train/{i}"}
            for i, p in enumerate(["hi", "yo"])
        ]
    return [
        {"task": "arithmetic", "question": f"{i}+{i + 3}", "answer": str(2 * i + 3), "id": f"t/{i}"}
        for i in range(P)
    ]


def start_talk(folder, env_module, sizes):
    """An engine whose rows talk to the Echo environment, and one rollout of P x G rows."""
    cfg = engine_cfg(folder, f"data.environment={env_module}:Echo", *sizes)
    engine, graphdef = build_engine(cfg, folder)
    params = nnx.state(from_pretrained(folder))
    examples = examples_for(cfg)
    before = sampling.compile_count()
    result = engine.rollout(graphdef, params, examples, jax.random.key(3), 0, G)
    compiles = sampling.compile_count() - before
    return dict(
        cfg=cfg,
        folder=folder,
        engine=engine,
        graphdef=graphdef,
        params=params,
        examples=examples,
        result=result,
        compiles=compiles,
    )


@pytest.fixture(scope="module")
def focused(tmp_path_factory):
    return focused_model(tmp_path_factory.mktemp("focused") / "m")


@pytest.fixture(scope="module")
def short_talk(focused, env_module):
    talk = start_talk(focused, env_module, SHORT)
    yield talk
    talk["engine"].task.close()


@pytest.fixture(scope="module")
def long_talk(focused, env_module):
    talk = start_talk(focused, env_module, LONG)
    yield talk
    talk["engine"].task.close()


def check_logprobs_and_mask(talk):
    """The trainer's forward (step.sequence_logprobs, as the train step runs it) over the
    rollout batch reproduces the sampler's logprob of every generated id of every turn; the
    loss mask is exactly the generated ids, the replies are attended but not trained."""
    result, ro = talk["result"], talk["cfg"].rollout
    batch = result.step_batch()
    assert result.batch["turns"].max() >= 2 and result.stats["turns/mean"] > 1
    forward = jax.jit(
        functools.partial(step.sequence_logprobs, talk["graphdef"], first_scored=ro.prompt_bucket)
    )
    params = nnx.to_pure_dict(talk["params"])
    lp = np.asarray(forward(params, batch.input_ids, batch.attention_mask, ro.temperature))
    m = batch.token_mask > 0
    error = float(np.mean(np.exp(np.abs(lp[m] - batch.generation_logprobs[m]))))
    assert round(error, 4) == 1.0, error
    np.testing.assert_allclose(lp[m], batch.generation_logprobs[m], atol=1e-4)
    n = ro.max_new_tokens
    tokens, region, attended = (
        np.asarray(x)[:, -n:] for x in (batch.input_ids, batch.token_mask, batch.attention_mask)
    )
    lengths = result.batch["lengths"]
    assert (attended.sum(1) == lengths).all() and (batch.attention_mask[:, :-n] >= m[:, :-n]).all()
    replies = (attended > 0) & (region == 0)
    assert replies.sum() == result.batch["reply_tokens"].sum() > 0
    tok = talk["engine"].tokenizer
    eos = tok.eos_token_id
    for b in range(len(lengths)):
        ids = tokens[b, : lengths[b]]
        gen = region[b, : lengths[b]] > 0
        # each generated run ends in the stop token (or the budget), each reply is the template's
        turns = np.flatnonzero(np.diff(np.concatenate([[0], gen.astype(int)])) == 1)
        assert len(turns) == result.batch["turns"][b]
        if result.batch["turns"][b] >= 2:
            text = tok.decode(ids[~gen])
            assert text.startswith("\n<|im_start|>user\nstep 1<|im_end|>\n<|im_start|>assistant\n")
        ends = [i for i in range(1, len(ids)) if gen[i - 1] and not gen[i]]
        assert all(ids[i - 1] == eos for i in ends)


def test_trainer_forward_reproduces_every_turns_logprobs(short_talk):
    check_logprobs_and_mask(short_talk)


def test_two_turns_share_one_compiled_program(short_talk):
    """Turn 2 runs every row again (rows bucket 8), its conversations fit the first turn's
    context width (64) and its budget rounds up to the same 64 tokens: no new program."""
    assert short_talk["result"].batch["turns"].min() == 2
    assert short_talk["compiles"] == 1


@pytest.mark.heavy  # make test: test_packing.py::test_packed_step_equals_the_unpacked_step
# (hand-built reply holes in the token mask)
def test_a_conversation_batch_packs_to_the_unpacked_step(short_talk):
    """The rollout's batch (tool replies inside the completions: attended, not scored) through
    the train step packed (grpo.sequence_packing) and unpacked: the same loss, metrics and
    gradients (tests/test_packing.py's comparison). Rewards made distinct: a real gradient."""
    from test_packing import assert_same, batch_math

    host = short_talk["result"].step_batch()
    gen = host.token_mask > 0
    reply = (host.attention_mask > 0) & ~gen
    after_reply = np.cumsum(reply[:, short_talk["cfg"].rollout.prompt_bucket :], axis=1) > 0
    assert (gen[:, short_talk["cfg"].rollout.prompt_bucket :] & after_reply).any(1).all()
    host = host.replace(rewards=np.arange(len(host.rewards), dtype=np.float32))
    model = from_pretrained(short_talk["folder"])
    cfg, out = short_talk["cfg"], {}
    for packed in (False, True):
        run = cfg.replace(
            grpo=dataclasses.replace(cfg.grpo, sequence_packing=packed),
            mesh=dataclasses.replace(cfg.mesh, data=1),
        )
        built = step_setup.build_step(
            run, model, mesh=sharding.make_mesh(run.mesh, jax.devices()[:1])
        )
        if packed:  # 8 conversations of 64 + 64 columns in fewer packed rows
            assert built.device_batch(host).layout.input_ids.shape[0] < len(host.rewards)
        out[packed] = batch_math(built, host, None)
    assert_same(out[True], out[False])


@pytest.mark.heavy  # make test: the same checks on two turns (test_trainer_forward_...)
def test_long_conversations(long_talk):
    """Four turns over growing contexts: every turn's logprobs; at most one program per turn."""
    check_logprobs_and_mask(long_talk)
    assert long_talk["result"].batch["turns"].max() >= 3
    assert 1 <= long_talk["compiles"] <= long_talk["cfg"].rollout.max_turns


@pytest.mark.heavy  # make test: test_tool_calls_run_and_their_replies_join_the_row (rows keyed
# by their global index in every turn) and test_sampling's split-batch test
def test_a_split_rollout_is_the_whole_rollout(long_talk):
    """What Ray workers do: each part keyed by its first prompt; joined, the parts are the
    whole batch (logprobs up to the float rounding of programs compiled for another number of
    rows, as in test_ray)."""
    engine, graphdef, params, examples = (
        long_talk[k] for k in ("engine", "graphdef", "params", "examples")
    )
    parts = [
        engine.rollout(
            graphdef, params, examples[i : i + 1], jax.random.key(3), 0, G, first_prompt=i
        )
        for i in range(P)
    ]
    joined = concat_results(parts, [0, 1])
    whole = long_talk["result"]
    for key in whole.batch:
        if key != "generation_logprobs":
            np.testing.assert_array_equal(joined.batch[key], whole.batch[key], err_msg=key)
    np.testing.assert_allclose(
        joined.batch["generation_logprobs"], whole.batch["generation_logprobs"], rtol=0, atol=4e-6
    )
    for key, value in whole.stats.items():
        if not key.startswith("perf/"):
            assert joined.stats[key] == value, key


def test_one_turn_is_the_single_turn_rollout_bit_for_bit(short_talk):
    """max_turns 1 without tools or environment: the batch of the single-turn path
    (sampling.generate, decode, score, the prompt ++ completion arrays) and no turn metrics."""
    talk = short_talk  # the same shapes (8 rows, 64 + 64 tokens): the same compiled program
    sizes = ("data.use_chat_template=false", *SHORT[1:-1])
    cfg = engine_cfg(talk["folder"], "data.task=arithmetic", "data.max_operand=9", *sizes)
    engine, graphdef = build_engine(cfg, talk["folder"])
    params, key = talk["params"], jax.random.key(5)
    examples = examples_for(cfg)
    got = engine.rollout(graphdef, params, examples, key, 7, G)
    texts, ids = engine.prompts(examples)
    rows = [i for i in range(P) for _ in range(G)]
    gen = sampling.generate((graphdef, params), [ids[i] for i in rows], engine.train_params, key)
    completions = [
        engine.tokenizer.decode(gen.tokens[b, : gen.lengths[b]], skip_special_tokens=True)
        for b in range(len(rows))
    ]
    rewards, info = engine.task.score(
        [texts[i] for i in rows],
        completions,
        [examples[i] for i in rows],
        [gen.tokens[b, : gen.lengths[b]].tolist() for b in range(len(rows))],
    )
    p = gen.prompt_tokens.shape[1]
    gen_mask = np.arange(gen.tokens.shape[1])[None] < gen.lengths[:, None]
    want = {
        "input_ids": np.concatenate([gen.prompt_tokens, gen.tokens], 1),
        "attention_mask": np.concatenate(
            [np.arange(p)[None] >= p - gen.prompt_lengths[:, None], gen_mask], 1
        ).astype(np.float32),
        "token_mask": np.concatenate([np.zeros((len(rows), p), bool), gen_mask], 1),
        "generation_logprobs": np.concatenate(
            [np.zeros((len(rows), p)), np.where(gen_mask, gen.logprobs, 0)], 1
        ),
        "rewards": rewards,
        "lengths": gen.lengths,
        "truncated": gen.truncated,
        "correct": info["correct"],
    }
    for k, v in want.items():
        np.testing.assert_array_equal(got.batch[k], np.asarray(v, got.batch[k].dtype), err_msg=k)
    assert not any(k.startswith(("turns/", "tools/", "tokens/")) for k in got.stats)
    assert "turns" not in got.batch and got.samples[0]["completion"] == completions[0]
    engine.task.close()


def test_a_rollout_repeats_exactly(short_talk):
    """A rollout is a function of (params, examples, key), environments included (a fresh one
    per row and rollout): what an exact resume relies on."""
    talk = short_talk
    again = talk["engine"].rollout(
        talk["graphdef"], talk["params"], talk["examples"], jax.random.key(3), 0, G
    )
    for key, value in talk["result"].batch.items():
        np.testing.assert_array_equal(again.batch[key], value, err_msg=key)


# ----------------------------------------------------------------------------- train.run

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
RUN = (
    "data.task=calculator",
    "data.operators='*'",
    "data.min_operand=10",
    "data.max_operand=99",
    "data.num_val_examples=4",
    "rollout.max_turns=2",
    "rollout.max_new_tokens=64",
    "rollout.prompt_bucket=64",
    "grpo.max_num_steps=3",
    "grpo.val_at_start=false",
    "grpo.val_at_end=false",
    "checkpoint.save_period=2",
    "optim.learning_rate=1e-3",
    "logging.tensorboard=false",
)


@pytest.mark.parametrize("command", ["train", "eval"])
def test_a_template_without_a_turn_end_is_refused_before_the_model_loads(command, tmp_path, capsys):
    """`jgrpo train` and `jgrpo eval` both check the chat template before loading (exit 2)."""
    from test_conversation import PLAIN_TEMPLATE, base_model_folder

    from jgrpo import cli

    folder = base_model_folder(tmp_path / "plain", PLAIN_TEMPLATE)
    argv = [command, "--config", TINY, f"model.path={folder}"]
    if command == "train":
        argv[1:1] = ["--run-dir", str(tmp_path / "run")]
    code = cli.main([*argv, *RUN])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"jgrpo: error: model.path: {str(folder)!r}: multi-turn rollouts")
    assert "set rollout.max_turns: 1" in err[0]


def run_calculator(run_dir, folder, env_module, *overrides, resume=False):
    """3 GRPO steps on the calculator task: the focused model's <tool_call> tags make
    malformed calls (answered with errors), its other turns go to the Echo environment."""
    cfg = load_config(
        TINY,
        [
            f"model.path={folder}",
            f"data.environment={env_module}:Echo",
            "data.tool_processes=1",
            *RUN,
            *overrides,
        ],
    )
    train.run(cfg, run_dir, resume=resume)
    return read_metrics(run_dir)


def is_timing(key):
    return key.startswith("perf/") or key.endswith("_s")


def assert_same_metrics(got, want):
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3]
    for g, w in zip(got, want):
        for key, value in w.items():
            if not is_timing(key):
                assert g[key] == value, (w["step"], key, g[key], value)


@pytest.fixture(scope="module")
def local_run(tmp_path_factory, focused, env_module):
    return run_calculator(tmp_path_factory.mktemp("local") / "run", focused, env_module)


@pytest.mark.heavy  # make test: test_trainer_forward_reproduces_every_turns_logprobs
def test_run_trains_on_conversations(local_run):
    for r in local_run:
        assert r["turns/mean"] > 1 and r["turns/max"] == 2 and r["tools/calls"] > 0
        assert r["tools/errors"] == r["tools/calls"]  # every focused-model call is malformed
        assert r["tokens/tool_fraction"] > 0.1 and np.isfinite(r["loss/total"])
        assert round(r["logprob/token_mult_prob_error"], 4) == 1.0
        assert r["reward/environment/mean"] > 0


@pytest.mark.heavy  # make test: test_a_rollout_repeats_exactly (what resume relies on)
def test_resume_is_exact(tmp_path, local_run, focused, env_module, monkeypatch):
    from jgrpo.rollout import LocalRollout, RolloutFailure

    collect = LocalRollout.collect

    def failing_collect(self, step, gen_batch=0):
        if step == 2:
            raise RolloutFailure("worker budget exhausted (test)")
        return collect(self, step, gen_batch)

    monkeypatch.setattr(LocalRollout, "collect", failing_collect)
    with pytest.raises(train.RunStopped):
        run_calculator(tmp_path / "run", focused, env_module)
    monkeypatch.setattr(LocalRollout, "collect", collect)
    rows = run_calculator(tmp_path / "run", focused, env_module, resume=True)
    assert_same_metrics(rows, local_run)


@pytest.mark.heavy  # make test: test_a_split_rollout... is heavy too; the twin of both is
# test_tool_calls_run_and_their_replies_join_the_row (global row keys in every turn)
def test_ray_workers_run_the_same_conversations(
    tmp_path, local_run, focused, env_module, ray_cluster
):
    rows = run_calculator(
        tmp_path / "run", focused, env_module, "rollout.backend=ray", "rollout.num_workers=1"
    )
    for g, w in zip(rows, local_run):
        for key, value in w.items():
            if not is_timing(key) and not key.startswith("rollout/"):
                assert g[key] == value, (w["step"], key, g[key], value)


@pytest.mark.heavy  # make test: test_trainer_forward_reproduces_every_turns_logprobs
def test_lora_trains_on_conversations(tmp_path, focused, env_module):
    rows = run_calculator(tmp_path / "run", focused, env_module, "model.lora.rank=4")
    for r in rows:
        assert r["turns/mean"] > 1 and round(r["logprob/token_mult_prob_error"], 4) == 1.0
        assert np.isfinite(r["loss/total"]) and r["train/grad_norm"] > 0


@pytest.mark.heavy  # make test: test_tool_calls_run_and_their_replies_join_the_row (global rows)
def test_two_process_pod_runs_the_same_conversations(tmp_path, focused):
    """Each host of a 2-process pod runs its rows' conversations; the pod's metrics are the
    one-process run's (up to the float rounding of another number of rows per host)."""
    from test_distributed import REWARD, _launch, _log, _wait

    (tmp_path / "pod_rewards.py").write_text(REWARD)
    (tmp_path / "jgrpo_test_envs.py").write_text(ENV_MODULE)
    env = ["data.environment=jgrpo_test_envs:Echo", "data.tool_processes=1"]
    extra = [f"model.path={focused}", *env, *RUN[:-3]]  # the pod's own checkpoint/log settings
    runs = {n: str(tmp_path / f"run{n}") for n in (1, 2)}
    procs = {n: _launch(tmp_path, runs[n], n, *extra) for n in (1, 2)}
    for n, p in procs.items():
        assert _wait(p) == [0] * n, _log(tmp_path, runs[n], 0)[-3000:]
    one, pod = read_metrics(runs[1]), read_metrics(runs[2])
    assert [r["step"] for r in pod] == [r["step"] for r in one] == [1, 2, 3]
    keys = ("loss/total", "reward/mean", "turns/mean", "tools/calls", "tokens/tool_fraction")
    for a, b in zip(pod, one):
        assert b["turns/mean"] > 1
        for key in keys:
            assert a[key] == pytest.approx(b[key], abs=1e-5), (b["step"], key)
