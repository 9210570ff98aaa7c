"""Countdown: reach a target from given numbers with + - * / and parentheses.

Puzzles are generated solvable: a random expression tree over all the numbers (drawn from
[1, data.max_operand]) is evaluated with exact divisions and non-negative intermediates, and its
value (a positive integer <= 999) becomes the target; that expression is the reference answer.
The verifier accepts any expression using each number at most once (`verify.verify_countdown`).

Bare prompt `3,5,2:16=`, reference completion `(3+5)*2`. File records need a `numbers` (or
`nums`) list of integers and an integer `target`; data.answer_key optionally holds a solution.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Optional

import numpy as np

from jgrpo.config import ConfigError, DataConfig
from jgrpo.tasks.data import Example
from jgrpo.tasks.verify import extract_expression, verify_countdown

_MAX_TARGET = 999
_TRIES = 32
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}
_INSTRUCTION = (
    "Using the numbers {numbers}, each at most once, and only + - * / and parentheses, write an "
    "expression that equals {target}. Give the final expression after ####."
)


def _combine(left, right, op):
    """Join two (text, value, precedence) items with the fewest parentheses that keep the value."""
    ltext, lval, lprec = left
    rtext, rval, rprec = right
    prec = _PRECEDENCE[op]
    if lprec < prec:
        ltext = f"({ltext})"
    if rprec < prec or (rprec == prec and op in "-/"):
        rtext = f"({rtext})"
    value = {
        "+": lval + rval,
        "-": lval - rval,
        "*": lval * rval,
        "/": lval / rval if rval else None,
    }[op]
    return f"{ltext}{op}{rtext}", value, prec


def _random_solution(numbers: list[int], rng: np.random.Generator):
    """A random expression over all `numbers` as (text, value), or None if it went astray."""
    items = [(str(n), Fraction(n), 3) for n in rng.permutation(numbers).tolist()]
    while len(items) > 1:
        j = int(rng.integers(0, len(items) - 1))
        op = "+-*/"[int(rng.integers(0, 4))]
        text, value, prec = _combine(items[j], items[j + 1], op)
        if value is None or value < 0 or value.denominator != 1:
            return None
        items[j : j + 2] = [(text, value, prec)]
    text, value, _ = items[0]
    return (text, int(value)) if 1 <= value <= _MAX_TARGET else None


class CountdownTask:
    """Prompts, references and the verifier of the countdown task."""

    name = "countdown"
    space_keys = ("max_operand", "countdown_num_numbers")
    """DataConfig fields that set `space_size`."""

    def __init__(self, cfg: DataConfig):
        if cfg.max_operand < 1:
            raise ConfigError(
                "data.max_operand: countdown draws numbers from [1, max_operand]; "
                f"must be >= 1, got {cfg.max_operand}"
            )
        if cfg.countdown_num_numbers < 1:
            raise ConfigError("data.countdown_num_numbers: must be >= 1")
        self.max_number = cfg.max_operand
        self.num_numbers = cfg.countdown_num_numbers

    @property
    def space_size(self) -> int:
        """Distinct number multisets (the dedup key between train and val)."""
        from math import comb

        return comb(self.max_number + self.num_numbers - 1, self.num_numbers)

    def generate(self, rng: np.random.Generator) -> tuple[tuple, Example]:
        numbers = rng.integers(1, self.max_number + 1, size=self.num_numbers).tolist()
        for _ in range(_TRIES):
            found = _random_solution(numbers, rng)
            if found is not None:
                break
        else:  # the plain sum always works: every number >= 1 and at most 99 * 10 < 999
            found = ("+".join(map(str, numbers)), sum(numbers))
            if found[1] > _MAX_TARGET:
                found = (str(numbers[0]), numbers[0])
        text, target = found
        example = {
            "task": self.name,
            "question": self.question(numbers, target),
            "answer": text,
            "numbers": numbers,
            "target": target,
        }
        return tuple(sorted(numbers)), example

    @staticmethod
    def question(numbers, target) -> str:
        return f"Use {', '.join(map(str, numbers))} to make {target}"

    def bare_prompt(self, example: Example) -> str:
        return f"{','.join(map(str, example['numbers']))}:{example['target']}="

    def instruction(self, example: Example) -> str:
        return _INSTRUCTION.format(numbers=list(example["numbers"]), target=example["target"])

    def reference_completion(self, example: Example) -> str:
        return str(example["answer"])

    def verify(self, completion: str, example: Example) -> bool:
        return verify_countdown(completion, example["numbers"], example["target"])

    def vote(self, completion: str) -> Optional[str]:
        return extract_expression(completion)

    def example_from_record(self, record: dict, index: int, where: str, cfg: DataConfig):
        numbers = record.get("numbers", record.get("nums"))
        target = record.get("target")
        ok = (
            isinstance(numbers, (list, tuple))
            and numbers
            and all(isinstance(n, int) and not isinstance(n, bool) for n in numbers)
            and isinstance(target, int)
            and not isinstance(target, bool)
        )
        if not ok:
            raise ConfigError(
                f"data.train_path / data.val_path: countdown record {index} of {where} needs a "
                f"'numbers' (or 'nums') list of integers and an integer 'target' "
                f"(fields: {', '.join(map(str, record))})"
            )
        numbers = [int(n) for n in numbers]
        return {
            "task": self.name,
            "question": self.question(numbers, target),
            "answer": str(record.get(cfg.answer_key) or ""),
            "numbers": numbers,
            "target": int(target),
        }
