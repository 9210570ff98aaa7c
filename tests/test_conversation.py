"""Conversations as token ids (jgrpo.rollout.conversation), tool-call parsing, the calculator
task and the tool/environment child processes (jgrpo.tasks.tools). No model: tokenizers only.

The references are the chat template's own renderings, tokenised whole, and the character
offsets of the assistant turns in them: a multi-turn row must be exactly that token sequence,
with the loss mask on exactly the assistant turns' tokens."""

import json
import re
import textwrap
import time

import pytest
from conftest import importable_modules
from transformers import AutoTokenizer

from jgrpo.config import ConfigError, DataConfig
from jgrpo.models.sources import check_model_path, resolve_model_path
from jgrpo.models.tiny import CHAT_TOKENS, TOOL_TOKENS, build_tiny_model
from jgrpo.rollout.conversation import ChatFormat
from jgrpo.rollout.tool_calls import ToolCall, parse_tool_calls
from jgrpo.tasks import make_task
from jgrpo.tasks.calculator import calculator
from jgrpo.tasks.child import ERROR, OK, TIMEOUT
from jgrpo.tasks.tools import ToolRunner


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    """builtin:tiny-qwen2-chat's tokenizer, loaded the way the trainer loads it."""
    folder = build_tiny_model(tmp_path_factory.mktemp("chat") / "m", chat=True)
    return AutoTokenizer.from_pretrained(folder)


CALC_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression exactly.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 347*29"}},
            "required": ["expression"],
        },
    },
}


def call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


TOOL_CONVERSATION = [
    {"role": "system", "content": "Use the tools."},
    {"role": "user", "content": "What is 347*29+1?"},
    {"role": "assistant", "content": "", "tool_calls": [call("calculator", expression="347*29")]},
    {"role": "tool", "name": "calculator", "content": "10063"},
    {
        "role": "assistant",
        "content": "Now add one.",
        "tool_calls": [
            call("calculator", expression="10063+1"),
            call("calculator", expression="1"),
        ],
    },
    {"role": "tool", "name": "calculator", "content": "10064"},
    {"role": "tool", "name": "calculator", "content": "1"},
    {"role": "assistant", "content": "10064"},
]
GAME_CONVERSATION = [  # an environment's observations are user messages
    {"role": "user", "content": "Guess my number (1-10)."},
    {"role": "assistant", "content": "Is it 7?"},
    {"role": "user", "content": "Lower."},
    {"role": "assistant", "content": "Then 3."},
]


def test_tiny_chat_tokenizer_loads_locally_and_renders_tools(chat_tok):
    assert type(chat_tok).__name__ == "Qwen2Tokenizer"  # what AutoTokenizer gives model_type qwen2
    assert chat_tok.eos_token == "<|im_end|>" and chat_tok.eos_token_id == 261
    for i, token in enumerate(CHAT_TOKENS + TOOL_TOKENS):
        assert chat_tok(token, add_special_tokens=False)["input_ids"] == [260 + i]
    text = chat_tok.apply_chat_template(
        TOOL_CONVERSATION[:2], tools=[CALC_SCHEMA], add_generation_prompt=True, tokenize=False
    )
    assert text == (
        "<|im_start|>system\nUse the tools.\n# Tools\ncalculator(expression): Evaluate an "
        "arithmetic expression exactly.<|im_end|>\n<|im_start|>user\nWhat is 347*29+1?<|im_end|>"
        "\n<|im_start|>assistant\n"
    )
    full = chat_tok.apply_chat_template(TOOL_CONVERSATION, tools=[CALC_SCHEMA], tokenize=False)
    assert (
        '<|im_start|>assistant\nNow add one.\n<tool_call>\n{"name": "calculator", "arguments": '
        '{"expression": "10063+1"}}\n</tool_call>\n<tool_call>\n{"name": "calculator", '
        '"arguments": {"expression": "1"}}\n</tool_call><|im_end|>\n<|im_start|>user\n'
        "<tool_response>\n10064\n</tool_response>\n<tool_response>\n1\n</tool_response><|im_end|>"
    ) in full
    ids = chat_tok(full, add_special_tokens=False)["input_ids"]
    # the tool tags survive skip_special_tokens (added, not special), the ChatML markers do not
    decoded = chat_tok.decode(ids, skip_special_tokens=True)
    assert "<tool_call>" in decoded and "<|im_start|>" not in decoded


def assistant_spans(text):
    """Character spans of every assistant turn's generated part: after the generation prompt
    `<|im_start|>assistant\\n` (or `<|im_start|>assistant` before a tool call) through
    `<|im_end|>`."""
    return [
        m.span(1)
        for m in re.finditer(r"<\|im_start\|>assistant\n?(.*?<\|im_end\|>)", text, re.DOTALL)
    ]


@pytest.mark.parametrize(
    "case",
    # heavy: make test runs the same rule on the tiny ChatML tokenizer (loading SmolLM2's 49k
    # BPE vocabulary costs seconds)
    ["tiny_tools", pytest.param("smollm2_game", marks=pytest.mark.heavy)],
)
def test_encode_is_the_template_token_by_token_with_the_mask_on_assistant_turns(case, chat_tok):
    if case == "tiny_tools":
        tok, conversation, tools = chat_tok, TOOL_CONVERSATION, [CALC_SCHEMA]
    else:  # a BPE tokenizer: boundary-stable at ChatML's special tokens
        tok = AutoTokenizer.from_pretrained(resolve_model_path("smollm2"))
        conversation, tools = GAME_CONVERSATION, None
    ids, mask = ChatFormat(tok, [tok.eos_token_id], tools).encode(conversation)
    text = tok.apply_chat_template(conversation, tools=tools, tokenize=False)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    full, offsets = enc["input_ids"], enc["offset_mapping"]
    assert ids == full[: len(ids)]
    assert tok.decode(full[len(ids) :]) == "\n"  # the template's newline after the last turn
    spans = assistant_spans(text)
    assert len(spans) == sum(m["role"] == "assistant" for m in conversation)
    want = [int(any(a <= s and e <= b for a, b in spans)) for s, e in offsets[: len(ids)]]
    assert mask == want
    assert sum(mask) > 10 and 0 < sum(mask) < len(mask)


def test_reply_ids_are_the_template_suffix_after_the_stop_token(chat_tok):
    chat = ChatFormat(chat_tok, [chat_tok.eos_token_id], [CALC_SCHEMA])
    tools = TOOL_CONVERSATION[5:7]
    assert chat_tok.decode(chat.reply_ids(tools)) == (
        "\n<|im_start|>user\n<tool_response>\n10064\n</tool_response>\n<tool_response>\n1\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    observation = [{"role": "user", "content": "Lower."}]
    assert chat_tok.decode(chat.reply_ids(observation)) == (
        "\n<|im_start|>user\nLower.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert chat_tok.decode(chat.reply_ids([])) == "\n<|im_start|>assistant\n"
    ids = chat.assistant_ids(TOOL_CONVERSATION[2])
    assert chat_tok.decode(ids) == (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "347*29"}}\n'
        "</tool_call><|im_end|>"
    )
    assert ids[-1] == chat_tok.eos_token_id


def test_hermes_tool_calls():
    text = 'Let me see.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    turn = parse_tool_calls(
        text + '<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}', "hermes"
    )
    assert turn.content == "Let me see."
    assert turn.calls == (ToolCall("add", {"a": 1}), ToolCall("f", {"x": 2}))  # unclosed: parsed
    assert turn.message()["tool_calls"][1] == call("f", x=2)
    bad = parse_tool_calls("<tool_call>{oops</tool_call><tool_call>[1]</tool_call>", "hermes")
    assert bad.calls == () and len(bad.errors) == 2 and "not valid JSON" in bad.errors[0]
    mixed = parse_tool_calls(
        '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{oops</tool_call>'
        '<tool_call>{"name": "b", "arguments": {}}</tool_call>',
        "hermes",
    )  # every block in the order of the text, the malformed one in its place
    assert mixed.blocks[0] == ToolCall("a", {}) and mixed.blocks[2] == ToolCall("b", {})
    assert mixed.blocks[1].startswith("error: the tool call is not valid JSON")
    plain = parse_tool_calls("  42 ", "hermes")
    assert (
        plain.content == "42"
        and not plain.calls
        and plain.message()
        == {
            "role": "assistant",
            "content": "42",
        }
    )


def test_calculator_task(chat_tok):
    assert calculator("347*29") == "10063" and calculator("7/2") == "3.5"
    assert calculator("(1+2)*3-10") == "-1"
    with pytest.raises(ValueError):
        calculator("__import__('os').getcwd()")
    cfg = DataConfig(
        task="calculator", operators="*", min_operand=100, max_operand=999, num_val_examples=8
    )
    task = make_task(cfg, 0, load_data=False)  # tools start lazily; no data needed here
    example = {"task": "calculator", "question": "347*29", "answer": "10063", "id": "x"}
    prompt = task.format_prompt(example, chat_tok, tools=[CALC_SCHEMA])
    assert prompt.endswith("<|im_start|>user\nWhat is 347*29?<|im_end|>\n<|im_start|>assistant\n")
    conversation = task.prompt_messages(example) + task.kind.reference_messages(example)
    ids, mask = ChatFormat(chat_tok, [chat_tok.eos_token_id], [CALC_SCHEMA]).encode(conversation)
    assert chat_tok.decode(ids).endswith(
        "</tool_response><|im_end|>\n<|im_start|>assistant\n10063<|im_end|>"
    )
    # a warm-start trace starts with exactly the ids of the rollout's prompt
    prompt_ids = chat_tok(prompt, add_special_tokens=False)["input_ids"]
    assert ids[: len(prompt_ids)] == prompt_ids and not any(mask[: len(prompt_ids)])
    assert task.verify("10063", example) and not task.verify("10062", example)
    rewards, info = task.score(["p"] * 2, ["10063", ""], [example] * 2)
    assert rewards.tolist() == [1.0, 0.0] and info["accuracy"] == 0.5


# ----------------------------------------------------------------------------- child processes

TOOLS_MODULE = textwrap.dedent(
    '''
    import os, signal, time

    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first
            b: the second
        """
        return a + b

    def fails(x: str) -> str:
        """Always raises.

        Args:
            x: anything
        """
        raise RuntimeError("tool broke: " + x)

    def sleeps(seconds: float) -> str:
        """Sleeps (a hang the SIGALRM timer interrupts).

        Args:
            seconds: how long
        """
        time.sleep(seconds)
        return "awake"

    def stuck(seconds: float) -> str:
        """Blocks SIGALRM, then sleeps: only the parent's kill ends it.

        Args:
            seconds: how long
        """
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(seconds)
        return "awake"

    def crashes() -> str:
        """Exits the process."""
        os._exit(3)

    def opaque() -> object:
        """Returns something that is not text."""
        return object()

    def payload() -> dict:
        """Returns JSON-able data."""
        return {"n": [1, 2.5, None]}

    class Counter:
        def reset(self, start=0, **record):
            self.n = int(start)
            if self.n < 0:
                raise ValueError("negative start")
            return f"at {self.n}"

        def step(self, text):
            self.n += 1
            if text == "bad":
                return "not a tuple"
            return f"at {self.n}", float(self.n), self.n >= 3
    '''
)


@pytest.fixture(scope="module")
def tools_module(tmp_path_factory):
    no_docs = "def f(x: int) -> int:\n    return x\n"
    sources = {"jgrpo_test_tools": TOOLS_MODULE, "jgrpo_test_no_docs": no_docs}
    for _ in importable_modules(tmp_path_factory, sources):
        yield "jgrpo_test_tools"


@pytest.fixture(scope="module")
def runner(tools_module):
    names = ["add", "fails", "sleeps", "stuck", "crashes", "opaque", "payload"]
    r = ToolRunner(
        [f"{tools_module}:{n}" for n in names],
        [f"data.tools[{i}]" for i in range(len(names))],
        f"{tools_module}:Counter",
        timeout_s=0.5,
        import_timeout_s=60.0,
        num_processes=2,
    )
    r.start()
    yield r
    r.close()


def test_tool_schemas_come_from_the_child(runner):
    schemas = runner.schemas
    assert [s["function"]["name"] for s in schemas][:2] == ["add", "fails"]
    assert schemas[0]["function"]["parameters"]["required"] == ["a", "b"]


def test_failing_tools_become_error_messages_and_counts(runner):
    ops = [
        ("call", 0, ("add", {"a": 2, "b": 3})),
        ("call", 1, ("fails", {"x": "now"})),
        ("call", 2, ("sleeps", {"seconds": 30})),
        ("call", 3, ("opaque", {})),
        ("call", 4, ("payload", {})),
        ("call", 5, ("nope", {})),
        ("call", 6, ("add", {"a": 1})),
    ]
    start = time.monotonic()
    out = runner.run(ops)
    assert time.monotonic() - start < 10
    assert out[0] == (OK, "5") and out[4] == (OK, '{"n": [1, 2.5, null]}')
    assert out[1] == (ERROR, "error: RuntimeError: tool broke: now")
    assert out[2][0] == TIMEOUT and "did not finish within 0.5 s" in out[2][1]
    assert out[3] == (ERROR, "error: opaque returned a object, not text or JSON")
    assert out[5][0] == ERROR and "unknown tool 'nope'" in out[5][1]
    assert out[6][0] == ERROR and "missing 1 required positional argument" in out[6][1]


@pytest.mark.heavy  # make test: test_failing_tools_become_error_messages_and_counts (a hang
# that the timer ends); this one restarts both children
def test_a_hang_that_ignores_signals_or_a_crash_is_contained(runner):
    """Row 0's child is killed (stuck) and row 1's dies (crashes): their calls fail, the calls
    queued behind them rerun on the restarted children, the other rows are untouched."""
    ops = [
        ("call", 0, ("stuck", {"seconds": 60})),
        ("call", 1, ("crashes", {})),
        ("call", 2, ("add", {"a": 1, "b": 1})),  # child 0, queued behind the stuck call
        ("call", 3, ("add", {"a": 2, "b": 2})),  # child 1, queued behind the crash
    ]
    out = runner.run(ops)
    assert out[0][0] == TIMEOUT and out[1][0] == ERROR and "crashed" in out[1][1]
    assert out[2:] == [(OK, "2"), (OK, "4")]
    assert runner.run([("call", 5, ("add", {"a": 3, "b": 4}))]) == [(OK, "7")]


def test_environments_one_per_row(runner):
    out = runner.run(
        [("clear", -1, None)]
        + [("reset", b, {"start": s}) for b, s in enumerate([0, 1, -1])]
        + [("step", 0, "go"), ("step", 1, "go"), ("step", 2, "go")]
    )[1:]
    assert out[:3] == [(OK, "at 0"), (OK, "at 1"), (ERROR, "error: ValueError: negative start")]
    assert out[3] == (OK, ("at 1", 1.0, False)) and out[4] == (OK, ("at 2", 2.0, False))
    assert out[5][0] == ERROR  # row 2 has no environment
    again = runner.run([("step", 1, "go"), ("step", 0, "bad")])
    assert again[0] == (OK, ("at 3", 3.0, True))
    assert again[1][0] == ERROR and "step must return" in again[1][1]


def test_tool_start_up_errors_name_the_key(tools_module):
    def error(tools, environment=None):
        r = ToolRunner(tools, [f"data.tools[{i}]" for i in range(len(tools))], environment, 1, 30)
        with pytest.raises(ConfigError) as e:
            r.start()
        return str(e.value)

    # (a module that fails to import is the reward functions' start-up check: test_tasks)
    assert error(["jgrpo_test_no_docs:f"]).startswith("data.tools[0]: 'f' needs type hints")
    assert error([], f"{tools_module}:add").startswith("data.environment: ")


def test_multi_turn_config_rules_and_the_python_api():
    from jgrpo.api import build_config
    from jgrpo.config import load_config

    def error(*overrides):
        with pytest.raises(ConfigError) as e:
            load_config(None, list(overrides))
        return str(e.value)

    assert error("rollout.max_turns=3").startswith(
        "rollout.max_turns: 3 turns need something to answer a turn: data.tools"
    )
    assert error("data.tools=[add]").startswith("data.tools[0]: 'add' must look like")
    assert error("data.environment=Game").startswith("data.environment: 'Game' must look like")
    assert error("rollout.tool_call_format=json").startswith("rollout.tool_call_format: 'json'")
    assert error("rollout.max_tool_response_tokens=0").startswith(
        "rollout.max_tool_response_tokens: must be >= 1"
    )
    assert error("data.min_operand=10", "data.max_operand=9").startswith("data.min_operand: 10")
    assert load_config(None, ["data.task=calculator", "rollout.max_turns=2"]).rollout.max_turns == 2

    class Game:
        def reset(self, **record):
            return None

        def step(self, text):
            return None, 1.0, True

    cfg = build_config(None, ["rollout.max_turns=2"], tools=[calculator])  # arithmetic + a tool
    assert cfg.data.tools == (calculator,) and cfg.data.environment is None
    cfg = build_config(None, ["data.task=prompts"], environment=Game)  # no reward function needed
    assert cfg.data.environment is Game


# ----------------------------------------------------------------------------- turn-end tokens


def base_model_folder(folder, template=None):
    """The tiny chat model as a Qwen2.5 *base* model ships: its EOS (tokenizer and config.json)
    is a token the template never writes (<eos> here, <|endoftext|> there), while its ChatML
    template ends each turn with <|im_end|>; `template` replaces the chat template."""
    build_tiny_model(folder, chat=True)
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    tok_config["eos_token"] = "<eos>"
    if template is not None:
        tok_config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": 1}))
    return folder


def test_a_turn_end_token_that_is_not_the_eos_becomes_a_stop_token(tmp_path):
    tok = AutoTokenizer.from_pretrained(base_model_folder(tmp_path / "base"))
    im_end = tok.convert_tokens_to_ids(CHAT_TOKENS[1])
    assert tok.eos_token_id == 1 != im_end
    chat = ChatFormat(tok, [tok.eos_token_id])
    assert chat.stop_ids == (1, im_end)
    reply = chat.reply_ids([{"role": "tool", "name": "f", "content": "7"}])
    assert tok.decode(reply) == "\n<|im_start|>user\n<tool_response>\n7\n</tool_response>" + (
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    assert chat.assistant_ids({"role": "assistant", "content": "hi"})[-1] == im_end


PLAIN_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def test_check_turn_template_before_any_load(tmp_path):
    """model.path's template is checked with config.json, for multi-turn runs only: one line
    naming what to set; the base-model case (EOS is not the turn end) passes."""
    check_model_path(str(base_model_folder(tmp_path / "base")), multi_turn=True)
    plain = str(base_model_folder(tmp_path / "plain", PLAIN_TEMPLATE))
    check_model_path(plain)  # single-turn: the template does not matter
    with pytest.raises(ConfigError) as e:
        check_model_path(plain, multi_turn=True)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"model.path: {plain!r}: multi-turn")
    assert "ends an assistant turn with none of the stop tokens ['<eos>']" in message
    assert "set rollout.max_turns: 1" in message
