"""GSM8K-format records: a question and an answer text ending in `#### N`.

Bare prompt `Q: {question}\\nA:`; reference completion ` {solution}` with the `<<a*b=c>>`
calculator annotations removed, ending in `#### N`. Verified numerically against N.
Records are read from data.train_path / data.val_path (fields data.question_key and
data.answer_key); an answer without `####` must itself be a number.
"""

from __future__ import annotations

from typing import Optional

from jgrpo.config import ConfigError, DataConfig
from jgrpo.tasks.data import Example
from jgrpo.tasks.verify import (
    numeric_vote,
    reference_answer,
    strip_calculator_annotations,
    verify_numeric,
)

_INSTRUCTION = (
    "{question}\nSolve it step by step, then give the final answer as a number after ####."
)


def numeric_example_from_record(
    task: str, record: dict, index: int, where: str, cfg: DataConfig
) -> Example:
    """An example with a numeric reference answer; ConfigError naming the key and file."""
    for key, dotted in (
        (cfg.question_key, "data.question_key"),
        (cfg.answer_key, "data.answer_key"),
    ):
        if key not in record:
            raise ConfigError(
                f"{dotted}: record {index} of {where} has no field {key!r} "
                f"(fields: {', '.join(map(str, record))})"
            )
        if record[key] is None:
            raise ConfigError(f"{dotted}: record {index} of {where} has a null {key!r}")
    solution = str(record[cfg.answer_key])
    final = reference_answer(solution)
    if final is None:
        raise ConfigError(
            f"data.answer_key: record {index} of {where} has answer {solution[-60:]!r} with no "
            "final number (expected a number or text ending in '#### N')"
        )
    return {
        "task": task,
        "question": str(record[cfg.question_key]),
        "answer": final,
        "solution": solution,
    }


class GSM8KTask:
    """Prompts, references and the verifier of GSM8K-style word problems."""

    name = "gsm8k"
    space_size = None

    def __init__(self, cfg: DataConfig):
        pass

    def bare_prompt(self, example: Example) -> str:
        return f"Q: {example['question']}\nA:"

    def instruction(self, example: Example) -> str:
        return _INSTRUCTION.format(question=example["question"])

    def reference_completion(self, example: Example) -> str:
        solution = example.get("solution") or f"#### {example['answer']}"
        text = strip_calculator_annotations(solution).strip()
        if "####" not in text:
            text = f"{text}\n#### {example['answer']}"
        return f" {text}"

    def verify(self, completion: str, example: Example) -> bool:
        return verify_numeric(completion, str(example["answer"]))

    def vote(self, completion: str) -> Optional[str]:
        return numeric_vote(completion)

    def example_from_record(self, record: dict, index: int, where: str, cfg: DataConfig):
        return numeric_example_from_record(self.name, record, index, where, cfg)
