"""The calculator task of `make demo-tools` as a plain OpenAI-client agent (`make demo-agent`).

It imports nothing from jgrpo: any agent written against the OpenAI API can be a rollout as it
is (docs/agents.md). The tool is the agent's own; its schema is the one the warm start was
trained with, so the prompt is the same ids as the tool demo's.
"""

import ast
import json
import operator
from fractions import Fraction

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression exactly.",
            "parameters": {
                "type": "object",
                "properties": {
                    "expression": {
                        "type": "string",
                        "description": "integers with + - * / and parentheses, e.g. 347*29",
                    }
                },
                "required": ["expression"],
            },
            "return": {"type": "string"},
        },
    }
]
OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def calculate(expression: str) -> str:
    """`expression` evaluated exactly: integers, + - * / and parentheses (nothing `eval`ed)."""

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"not arithmetic: {expression!r}")

    result = value(ast.parse(expression, mode="eval").body)
    if result.denominator == 1:
        return str(result.numerator)
    return f"{float(result):.6f}".rstrip("0").rstrip(".")


async def solve(client, record):
    """Ask; run the calculator calls the model makes; ask again; return the final answer."""
    messages = list(record["prompt_messages"])
    for _ in range(2):  # the tool demo's two turns: call the tool, then answer
        response = await client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS
        )
        message = response.choices[0].message
        if not message.tool_calls:
            break
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            try:
                result = calculate(**json.loads(call.function.arguments))
            except Exception as e:  # noqa: BLE001 - the model sees the error, as a tool's
                result = "error: " + " ".join(f"{type(e).__name__}: {e}".split())[:300]
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return {"completion": message.content or ""}  # the task's verifier scores it
