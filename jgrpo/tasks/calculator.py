"""The calculator task: arithmetic a small model cannot do in its head, with a `calculator` tool.

Questions are the arithmetic task's (data.num_terms operands in [data.min_operand,
data.max_operand], data.operators; e.g. `347*29` with min 10, max 9999, operators `*`), asked as
the chat message "What is 347*29?" (a chat template is required: `builtin:tiny-qwen2-chat` has
one). The built-in tool `calculator(expression)` evaluates `+ - * /` and parentheses exactly
(jgrpo.tasks.verify.evaluate_expression: parsed with `ast`, nothing is `eval`ed). The verifier
reads the final assistant message (its text outside tool calls): correct when its number equals
the answer. `reference_messages` is the ideal conversation (call, result, answer): the SFT
target a warm start tokenises with `jgrpo.rollout.conversation.ChatFormat.encode`.
"""

from __future__ import annotations

from fractions import Fraction

from jgrpo.tasks.arithmetic import ArithmeticTask
from jgrpo.tasks.data import Example
from jgrpo.tasks.verify import evaluate_expression

CALCULATOR_TOOL = "jgrpo.tasks.calculator:calculator"
"""The task's built-in tool, put before data.tools."""


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: integers with + - * / and parentheses, e.g. 347*29
    """
    value, _ = evaluate_expression(expression)
    return format_number(value)


def format_number(value: Fraction) -> str:
    """An integer as digits; otherwise a decimal rounded to 6 places, trailing zeros dropped."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6f}".rstrip("0").rstrip(".")


class CalculatorTask(ArithmeticTask):
    """Arithmetic questions in chat form, answered with the calculator tool."""

    name = "calculator"
    tools = (CALCULATOR_TOOL,)
    has_messages = True
    """Prompts need the tokenizer's chat template."""

    def bare_prompt(self, example: Example) -> None:
        return None  # always the chat template: tool calls and replies are chat messages

    def instruction(self, example: Example) -> str:
        return f"What is {example['question']}?"

    def reference_messages(self, example: Example) -> list[dict]:
        """The ideal turns after the prompt: the tool call, its result, the answer."""
        call = {"name": "calculator", "arguments": {"expression": example["question"]}}
        return [
            {"role": "assistant", "content": "", "tool_calls": [{"function": call}]},
            {"role": "tool", "name": "calculator", "content": calculator(example["question"])},
            {"role": "assistant", "content": str(example["answer"])},
        ]
