"""Arithmetic: seeded synthetic expressions like `12+34-5` (or question/answer files).

Bare prompt `12+34-5=`, reference completion `41` (the trainer/SFT script appends EOS). Results
follow the usual precedence (`*` before `+ -`) and may be negative. Verified numerically.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from jgrpo.config import ConfigError, DataConfig
from jgrpo.tasks.data import Example
from jgrpo.tasks.verify import evaluate_expression, numeric_vote, verify_numeric

_INSTRUCTION = "What is {question}? Give the final answer as a number after ####."


class ArithmeticTask:
    """Prompts, references and the verifier of the arithmetic task."""

    name = "arithmetic"
    space_keys = ("max_operand", "num_terms", "operators", "min_operand")
    """DataConfig fields that set `space_size`."""

    def __init__(self, cfg: DataConfig):
        ops = cfg.operators
        if not ops or not set(ops) <= set("+-*"):
            raise ConfigError(f"data.operators: {ops!r} must be a non-empty subset of '+-*'")
        if cfg.num_terms < 1 or not 0 <= cfg.min_operand <= cfg.max_operand:
            raise ConfigError(
                "data.num_terms must be >= 1 and 0 <= data.min_operand <= data.max_operand"
            )
        self.operators = sorted(set(ops))
        self.num_terms = cfg.num_terms
        self.min_operand = cfg.min_operand
        self.max_operand = cfg.max_operand

    @property
    def space_size(self) -> int:
        """Distinct questions the generator can draw (all equally likely)."""
        operands = self.max_operand - self.min_operand + 1
        return operands**self.num_terms * len(self.operators) ** (self.num_terms - 1)

    def generate(self, rng: np.random.Generator) -> tuple[tuple, Example]:
        """(dedup key, example) drawn uniformly; the id is filled in by the caller."""
        operands = rng.integers(self.min_operand, self.max_operand + 1, size=self.num_terms)
        ops = rng.choice(self.operators, size=self.num_terms - 1)
        question = str(operands[0]) + "".join(f"{op}{x}" for op, x in zip(ops, operands[1:]))
        value, _ = evaluate_expression(question)
        return question, {"task": self.name, "question": question, "answer": str(int(value))}

    def bare_prompt(self, example: Example) -> str:
        return f"{example['question']}="

    def instruction(self, example: Example) -> str:
        return _INSTRUCTION.format(question=example["question"])

    def reference_completion(self, example: Example) -> str:
        return str(example["answer"])

    def verify(self, completion: str, example: Example) -> bool:
        return verify_numeric(completion, str(example["answer"]))

    def vote(self, completion: str) -> Optional[str]:
        return numeric_vote(completion)

    def example_from_record(self, record: dict, index: int, where: str, cfg: DataConfig):
        from jgrpo.tasks.gsm8k import numeric_example_from_record

        return numeric_example_from_record(self.name, record, index, where, cfg)
