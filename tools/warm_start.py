"""Warm start of a demo: a tiny random Qwen2 fine-tuned by `jgrpo sft` on the config's task, cached.

    python tools/warm_start.py --config configs/demo.yaml        # what `make demo` runs
    python tools/warm_start.py --config configs/demo_tools.yaml --steps 240 --batch-size 32
                                                     # what `make demo-tools` runs

Reads the task (data.*) and the output folder (model.path) from the training config, so the
warm start and the GRPO run always agree on the task. Then:

  1. builds the tiny random Qwen2 (`build_tiny_model`, size from --hidden/--layers/...; a chat
     task such as calculator gets the ChatML tokenizer with the tool-aware template),
  2. writes the SFT records (JSONL) of the task's training stream (which excludes the held-out
     set), in training order: bare tasks `{"prompt": "12+34=", "completion": "46"}`, chat tasks
     `{"messages": [...]}`, the task's ideal conversation (calculator: call, result, answer) or,
     for --direct-fraction of them after --direct-after steps, a direct answer,
  3. runs `jgrpo sft` on them (a config written beside them: the training config's data and
     rollout sections, the model float32 without remat, sft.shuffle false so step i trains on
     records i*B..(i+1)*B-1, AdamW with a cosine schedule): the loss on the target tokens only,
     laid out exactly as a rollout lays them out; its final validation measures greedy held-out
     accuracy the way `jgrpo train` validates (same task.val),
  4. copies the run's final/ HF folder to model.path (atomically), with `warm_start.json`
     holding the settings, their hash and the results.

Deterministic: the same settings give the same bytes (fixed seeds, one compiled program, data in
a fixed order). Cached: when model.path exists and its `warm_start.json` has the same settings
hash, nothing is done; a different hash rebuilds it. The budget (--steps) is chosen on purpose
to stop early: a partially competent model leaves GRPO room to improve.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

FORMAT_VERSION = 3
"""Bump when this script's output for the same settings changes (2: trained by `jgrpo sft`;
3: its warmup starts at 0, `warmup_start`)."""
DIRECT_ANSWER = "The answer is {answer}."
"""A direct answer's text (`--direct-fraction`): its first token differs from a tool call's and
is the same for every question, so choosing to answer rather than call the tool is one token's
choice (a bare number would spread that choice over ten first digits, and greedy decoding would
call the tool whenever the tool token outweighs the likeliest digit)."""
SETTINGS_FILE = "warm_start.json"
"""Written into the output folder: settings, their hash and the SFT results."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    """Everything that decides the warm-start weights (hashed into the cache key)."""

    data: dict
    """The training config's data section (task and difficulty knobs)."""
    hidden_size: int = 128
    """d of the tiny Qwen2."""
    num_layers: int = 2
    """Decoder layers."""
    num_heads: int = 4
    """Attention heads."""
    num_kv_heads: int = 2
    """Key/value heads (GQA)."""
    intermediate_size: int = 256
    """f of the SwiGLU MLP."""
    init_seed: int = 0
    """Seed of the random init."""
    data_seed: int = 1
    """Seed of the SFT data order (the task's training stream)."""
    steps: int = 400
    """Optimizer steps."""
    batch_size: int = 64
    """Examples per step."""
    learning_rate: float = 3e-3
    """Peak AdamW learning rate (linear warmup, cosine decay to 10%)."""
    warmup_steps: int = 50
    """Linear warmup steps W."""
    warmup_start: float | None = 0.0
    """optim.warmup_start_ratio of the SFT: update k < W uses warmup_start + (1 - warmup_start)
    k/W of the peak; None (`--warmup-start none`) jgrpo's (k+1)/W. 0 is optax's warmup, the one
    `make demo`'s and `make demo-tools`' warm starts were tuned with (the loop before `jgrpo sft`):
    with it `jgrpo sft` writes that loop's weights byte for byte (docs/performance.md, "The warm
    starts by `jgrpo sft`"). `make distill`'s student was tuned with None."""
    direct_fraction: float = 0.0
    """Chat tasks with tools: the fraction of SFT conversations in which the assistant answers at
    once, without calling a tool (the rest are the task's ideal tool conversation). Drawn per
    example from data_seed. Above 0.5 the warm-started model's greedy first move is to answer from
    its head; sampling still calls the tool about (1 - direct_fraction) of the time, which is the
    choice GRPO's reward then settles."""
    direct_after: int = 0
    """Steps before the direct answers are mixed in: the first `direct_after` steps train on the
    tool conversation only (copying the tool's result is learned fastest without the direct
    answers' unlearnable digits in the batch), the rest on the `direct_fraction` mix."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    format_version: int = FORMAT_VERSION

    def key(self) -> str:
        text = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _ratio_or_none(text: str) -> float | None:
    return None if text.lower() == "none" else float(text)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--config", default="configs/demo.yaml", help="training config (data, model.path)"
    )
    ap.add_argument("--out", default=None, help="output folder (default: the config's model.path)")
    for f in dataclasses.fields(Settings):
        if f.name in ("data", "format_version"):
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = _ratio_or_none if f.name == "warmup_start" else type(f.default)
        ap.add_argument(flag, type=kind, default=f.default, help=f"(default {f.default})")
    ap.add_argument("--force", action="store_true", help="rebuild even if the cache matches")
    ap.add_argument("--no-eval", action="store_true", help="skip the held-out accuracy")
    return ap.parse_args(argv)


# ----------------------------------------------------------------------------- data


def direct_rows(settings: Settings):
    """[steps x batch_size] bool: which SFT conversations answer at once (`direct_fraction`,
    none in the first `direct_after` steps), drawn from data_seed."""
    import numpy as np

    s = settings
    direct = np.random.default_rng(s.data_seed).random(s.steps * s.batch_size) < s.direct_fraction
    direct[: s.direct_after * s.batch_size] = False
    return direct


def assistant_turns(task, example, direct: bool) -> list[dict]:
    """The messages after the prompt: the task's ideal conversation (with its tool calls), or
    (`direct`) one assistant answer without the tool, `DIRECT_ANSWER`."""
    if direct:
        return [{"role": "assistant", "content": DIRECT_ANSWER.format(answer=example["answer"])}]
    return task.kind.reference_messages(example)


def sft_records(settings: Settings, cfg) -> list[dict]:
    """The SFT records of the task's next steps x batch_size training examples, in order."""
    from jgrpo.tasks import make_task

    s = settings
    task = make_task(dataclasses.replace(cfg.data, use_chat_template=False), s.data_seed)
    try:
        examples = task.train.next_prompts(s.steps * s.batch_size)
        if not task.needs_chat_template:
            return [
                {"prompt": task.format_prompt(ex), "completion": task.reference_completion(ex)}
                for ex in examples
            ]
        if not hasattr(task.kind, "reference_messages"):
            raise SystemExit(f"warm start: task {task.cfg.task!r} has no reference conversation")
        return [
            {"messages": task.prompt_messages(ex) + assistant_turns(task, ex, d)}
            for ex, d in zip(examples, direct_rows(s))
        ]
    finally:
        task.close()


def sft_config(settings: Settings, cfg, base: Path, records: Path, length: int) -> dict:
    """The `jgrpo sft` config of the warm start (module docstring, step 3)."""
    from jgrpo.config import to_dict

    s, full = settings, to_dict(cfg)
    return {
        "model": {
            "path": str(base),
            "dtype": "float32",
            "compute_dtype": "float32",
            "remat": "none",
        },
        "data": full["data"],
        "rollout": full["rollout"],
        "grpo": {"seed": cfg.grpo.seed, "val_num_generations": 1, "val_pass_at": [1]},
        "optim": {
            "learning_rate": s.learning_rate,
            "schedule": "cosine",
            "min_lr_ratio": 0.1,
            "warmup_steps": s.warmup_steps,
            "warmup_start_ratio": s.warmup_start,
            "weight_decay": s.weight_decay,
            "max_grad_norm": 1.0,
        },
        "sft": {
            "train_path": str(records),
            "shuffle": False,
            "seed": s.data_seed,
            "batch_size": s.batch_size,
            "max_num_steps": s.steps,
            "max_seq_length": length,
            "val_period": 0,
            "val_at_end": True,
        },
        "checkpoint": {"save_period": 0},
        "logging": {"tensorboard": False, "plot": False, "progress_bar": False},
    }


# ----------------------------------------------------------------------------- training


def check_direct(settings: Settings, cfg) -> str | None:
    """Why --direct-fraction / --direct-after cannot apply to this config's task, or None."""
    from jgrpo.tasks import make_task

    s = settings
    if not 0.0 <= s.direct_fraction <= 1.0:
        return f"--direct-fraction: must lie in [0, 1], got {s.direct_fraction}"
    if s.direct_after < 0:
        return f"--direct-after: must be >= 0, got {s.direct_after}"
    if s.direct_fraction > 0:
        task = make_task(cfg.data, s.data_seed, load_data=False)
        if not (task.needs_chat_template and hasattr(task.kind, "reference_messages")):
            return (
                f"--direct-fraction: data.task {cfg.data.task!r} has no reference conversation "
                "to mix direct answers into (a chat task with a tool, e.g. calculator)"
            )
    return None


def read_cached(out: Path) -> dict | None:
    try:
        return json.loads((out / SETTINGS_FILE).read_text())
    except (OSError, ValueError):
        return None


def build(settings: Settings, cfg, out: Path, *, evaluate: bool = True, log=print) -> dict:
    """Build the warm-start folder `out` by `jgrpo sft` (atomically, replacing a stale one);
    returns its record."""
    import shutil

    import yaml

    from jgrpo import cli
    from jgrpo.files import atomic_folder
    from jgrpo.models.tiny import build_tiny_model
    from jgrpo.tasks import make_task

    # chat tasks (calculator) need builtin:tiny-qwen2-chat's tokenizer and tool-aware template
    chat = make_task(cfg.data, settings.data_seed, load_data=False).needs_chat_template
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base = build_tiny_model(
            tmp / "base",
            seed=settings.init_seed,
            chat=chat,
            hidden_size=settings.hidden_size,
            num_hidden_layers=settings.num_layers,
            num_attention_heads=settings.num_heads,
            num_key_value_heads=settings.num_kv_heads,
            intermediate_size=settings.intermediate_size,
        )
        records = sft_records(settings, cfg)
        (tmp / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        length = longest_record(records, base, cfg)
        config = sft_config(settings, cfg, base, tmp / "records.jsonl", -(-length // 8) * 8)
        config["sft"]["val_accuracy"] = evaluate
        (tmp / "sft.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        argv = ["sft", "--config", str(tmp / "sft.yaml"), "--run-dir", str(tmp / "run")]
        code = cli.main(argv)
        if code != 0:
            raise SystemExit(f"warm start: jgrpo sft {' '.join(argv[1:])} exited {code}")
        losses = [row["loss/total"] for row in map(json.loads, open(tmp / "run" / "metrics.jsonl"))]
        summary = json.loads((tmp / "run" / "summary.json").read_text())
        record = {
            "settings": dataclasses.asdict(settings),
            "key": settings.key(),
            "loss_first": round(float(losses[0]), 6),
            "loss_last": round(float(losses[-1]), 6),
            "loss_every_10": [round(float(x), 6) for x in losses[::10]],
        }
        if evaluate and summary and "val/accuracy" in summary[-1]:
            record["val_accuracy"] = summary[-1]["val/accuracy"]
        with atomic_folder(out, overwrite=True) as folder:
            shutil.copytree(tmp / "run" / "final", folder, dirs_exist_ok=True)
            (folder / SETTINGS_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return record


def longest_record(records: list[dict], base: Path, cfg) -> int:
    """Tokens of the longest record as `jgrpo sft` lays it out (with the task's tool schemas):
    the most of the 64 records longest as JSON text (the char tokenizer spends a token per
    byte, so these hold the longest of each layout; rendering all of them twice took minutes)."""
    from jgrpo.rollout import load_tokenizer
    from jgrpo.sft_data import Encoder
    from jgrpo.tasks import make_task

    task = make_task(cfg.data, 0, load_data=False)
    try:
        tools = task.tool_runner.schemas if task.tool_runner.active else None
    finally:
        task.close()
    encoder = Encoder(load_tokenizer(base), cfg, tools)
    longest = sorted(records, key=lambda r: len(json.dumps(r)), reverse=True)[:64]
    return max(len(encoder.record(r, "record")[0]) for r in longest)


def main(argv=None) -> int:
    args = parse_args(argv)
    from jgrpo.config import ConfigError, load_config, to_dict

    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    fields = {f.name for f in dataclasses.fields(Settings)} - {"data", "format_version"}
    settings = Settings(data=to_dict(cfg.data), **{k: getattr(args, k) for k in fields})
    out = Path(args.out or cfg.model.path)
    problem = check_direct(settings, cfg)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2

    cached = read_cached(out)
    if cached and cached.get("key") == settings.key() and not args.force:
        acc = cached.get("val_accuracy")
        acc_text = f", held-out greedy accuracy {acc:.3f}" if acc is not None else ""
        print(f"warm start: cached {out} (settings {settings.key()}{acc_text})")
        return 0

    s = settings
    print(
        f"warm start: SFT of a tiny Qwen2 (d {s.hidden_size}, {s.num_layers} layers, "
        f"{s.num_heads} heads) on {cfg.data.task} for {s.steps} steps x {s.batch_size} "
        f"examples -> {out}"
    )
    start = time.perf_counter()
    record = build(settings, cfg, out, evaluate=not args.no_eval)
    acc = record.get("val_accuracy")
    acc_text = f"; held-out greedy accuracy {acc:.3f}" if acc is not None else ""
    print(
        f"warm start: loss {record['loss_first']:.3f} -> {record['loss_last']:.3f}{acc_text}; "
        f"{time.perf_counter() - start:.1f}s; wrote {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
