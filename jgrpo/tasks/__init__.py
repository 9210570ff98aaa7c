"""Tasks: datasets, prompts, reward functions and verifiers.

    task = make_task(cfg.data, seed=cfg.grpo.seed)      # ConfigError before any model loads
    batch = task.train.next_prompts(P)                  # list[Example], deterministic order
    ckpt["data"] = task.train.state()                   # JSON; task.train.restore(...) resumes
    prompt = task.format_prompt(example, tokenizer)     # chat template or bare "12+34="
    rewards_n, info = task.score(prompts, completions, examples, completion_ids)
    task.val                                            # fixed held-out list[Example]

Example fields: `id` ("train/17"), `task`; built-in tasks add `question`, `answer` (a number
string, a countdown solution, possibly "" from files); gsm8k/file records add `solution`,
countdown `numbers` and `target`, task `prompts` `row` (the record). Bare prompts: arithmetic
"12+34-5=" -> "41", countdown "3,5,2:16=" -> "(3+5)*2", gsm8k "Q: {question}\\nA:" ->
" {solution without <<..>>, ending '#### N'}"; calculator has none (chat, with a tool)."""

from jgrpo.tasks.child import UserCodeError
from jgrpo.tasks.data import Example, RecordStream, Rows, SyntheticStream, load_table, read_records
from jgrpo.tasks.rewards import RewardRunner, import_reward_function
from jgrpo.tasks.task import Task, make_task, run_task
from jgrpo.tasks.verify import (
    evaluate_expression,
    extract_answer,
    extract_expression,
    numbers_equal,
    parse_number,
    verify_countdown,
    verify_numeric,
)

__all__ = [
    "Example",
    "RecordStream",
    "RewardRunner",
    "Rows",
    "SyntheticStream",
    "Task",
    "UserCodeError",
    "evaluate_expression",
    "extract_answer",
    "extract_expression",
    "import_reward_function",
    "load_table",
    "make_task",
    "run_task",
    "numbers_equal",
    "parse_number",
    "read_records",
    "verify_countdown",
    "verify_numeric",
]
