"""Warm start of a demo: a tiny random Qwen2 fine-tuned (SFT) on the config's task, cached.

    python tools/warm_start.py --config configs/demo.yaml        # what `make demo` runs
    python tools/warm_start.py --config configs/demo_tools.yaml --steps 240 --batch-size 32
                                                     # what `make demo-tools` runs

Reads the task (data.*) and the output folder (model.path) from the training config, so the
warm start and the GRPO run always agree on the task. Then:

  1. builds the tiny random Qwen2 (`build_tiny_model`, size from --hidden/--layers/...; a chat
     task such as calculator gets the ChatML tokenizer with the tool-aware template),
  2. trains it with teacher forcing (loss: mean token NLL over the target tokens only; examples
     come from the task's training stream, which excludes the held-out set), AdamW, one jitted
     step, a fixed number of steps. Targets: bare tasks `12+34=` -> `46<eos>`; chat tasks the
     task's ideal conversation (calculator: call, result, answer) laid out by
     `jgrpo.rollout.conversation.ChatFormat.encode` exactly as a rollout lays it out (same
     prompt ids, tool schemas and reply ids), the loss on the assistant turns' ids only,
  3. measures greedy held-out accuracy the way `jgrpo train` validates (same task.val),
  4. writes an HF folder (config, safetensors, tokenizer) beside model.path and renames it into
     place, with `warm_start.json` holding the settings, their hash and the results.

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

FORMAT_VERSION = 1
"""Bump when this script's output for the same settings changes."""
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
    """Linear warmup steps."""
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
        ap.add_argument(
            flag, type=type(f.default), default=f.default, help=f"(default {f.default})"
        )
    ap.add_argument("--force", action="store_true", help="rebuild even if the cache matches")
    ap.add_argument("--no-eval", action="store_true", help="skip the held-out accuracy")
    return ap.parse_args(argv)


# ----------------------------------------------------------------------------- data


def encode(text: str) -> list[int]:
    """The tiny model's tokenizer: byte b is id 4 + b (jgrpo.models.tiny.char_tokenizer)."""
    return [4 + b for b in text.encode()]


def make_sft_arrays(task, num_rows: int, tokenizer, direct=None):
    """(input_ids [N, T] int32, loss_mask [N, T] f32) of the task's next `num_rows` training
    examples, right-padded: bare tasks prompt ++ completion ++ EOS, chat tasks the ideal
    conversation (`ChatFormat.encode`; `direct` [num_rows] bool: answered without the tool).
    loss_mask is 1 on the target ids (completion and EOS; each assistant turn through its
    end-of-turn id), aligned with the tokens they score."""
    import numpy as np

    eos_id, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    examples = task.train.next_prompts(num_rows)
    if task.needs_chat_template:
        rows = chat_traces(task, examples, tokenizer, direct)
    else:
        rows = []
        for ex in examples:
            prompt = encode(task.format_prompt(ex))
            target = encode(task.reference_completion(ex)) + [eos_id]
            rows.append((prompt + target, [0] * len(prompt) + [1] * len(target)))
    width = max(len(ids) for ids, _ in rows)
    width = -(-width // 8) * 8
    ids = np.full((num_rows, width), pad_id, np.int32)
    mask = np.zeros((num_rows, width), np.float32)
    for i, (row_ids, row_mask) in enumerate(rows):
        ids[i, : len(row_ids)] = row_ids
        mask[i, : len(row_mask)] = row_mask
    return ids, mask


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


def chat_traces(task, examples, tokenizer, direct=None) -> list[tuple[list[int], list[int]]]:
    """(ids, loss_mask) of each example's ideal conversation, as the rollout tokenises it: the
    tools' schemas from the task's tool processes, the EOS as the stop id (checked: the first
    trace starts with exactly the rollout's prompt ids). Where `direct[i]`, example i's
    assistant answers at once (`DIRECT_ANSWER`, no tool call)."""
    from jgrpo.rollout.conversation import ChatFormat

    if not hasattr(task.kind, "reference_messages"):
        raise SystemExit(f"warm start: task {task.cfg.task!r} has no reference conversation")
    schemas = task.tool_runner.schemas or None
    chat = ChatFormat(tokenizer, [tokenizer.eos_token_id], schemas)
    direct = [False] * len(examples) if direct is None else direct
    rows = [
        chat.encode(task.prompt_messages(ex) + assistant_turns(task, ex, d))
        for ex, d in zip(examples, direct)
    ]
    prompt = task.format_prompt(examples[0], tokenizer, tools=schemas)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert rows[0][0][: len(prompt_ids)] == prompt_ids, prompt
    return rows


# ----------------------------------------------------------------------------- training


def train_sft(settings: Settings, base_folder: Path, cfg, log=print):
    """SFT the model of `base_folder`; returns (trained model, losses per step [steps])."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from jgrpo.config import ModelConfig
    from jgrpo.models import load_policy
    from jgrpo.rollout import load_tokenizer
    from jgrpo.step import sequence_logprobs
    from jgrpo.tasks import make_task

    # float32 without remat: the TransformerConfig defaults the warm start always trained with
    model = load_policy(ModelConfig(path=str(base_folder), compute_dtype="float32", remat="none"))
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    tokenizer = load_tokenizer(base_folder)

    s = settings
    data_cfg = dataclasses.replace(cfg.data, use_chat_template=False)
    task = make_task(data_cfg, s.data_seed)
    try:
        ids, mask = make_sft_arrays(task, s.steps * s.batch_size, tokenizer, direct_rows(s))
        if not task.needs_chat_template:
            first = task.format_prompt(task.val[0]) + task.reference_completion(task.val[0])
            assert encode(first) == tokenizer(first, add_special_tokens=False)["input_ids"], first
    finally:
        task.close()
    ids = ids.reshape(s.steps, s.batch_size, -1)
    mask = mask.reshape(s.steps, s.batch_size, -1)

    schedule = optax.warmup_cosine_decay_schedule(
        0.0, s.learning_rate, s.warmup_steps, s.steps, end_value=0.1 * s.learning_rate
    )
    tx = optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=s.weight_decay)
    )
    opt_state = tx.init(params)

    def loss_fn(params, ids_bt, mask_bt):
        attention_bt = (ids_bt != tokenizer.pad_token_id) | (mask_bt > 0)
        lp_bt = sequence_logprobs(graphdef, params, ids_bt, attention_bt, 1.0)
        return -(lp_bt * mask_bt).sum() / mask_bt.sum()

    @jax.jit
    def train_step(params, opt_state, ids_bt, mask_bt):
        loss, grads = jax.value_and_grad(loss_fn)(params, ids_bt, mask_bt)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    start = time.perf_counter()
    for i in range(s.steps):
        params, opt_state, loss = train_step(
            params, opt_state, jnp.asarray(ids[i]), jnp.asarray(mask[i])
        )
        losses.append(loss)
        if (i + 1) % max(1, s.steps // 10) == 0 or i == 0:
            log(
                f"  sft step {i + 1:5d}/{s.steps}  loss {float(loss):.4f}  "
                f"({time.perf_counter() - start:.1f}s)"
            )
    nnx.update(model, nnx.State(params))
    return model, np.asarray(jax.device_get(losses), np.float64)


def evaluate_folder(cfg, folder: Path) -> float:
    """Greedy held-out accuracy of the HF folder on the config's task (as `jgrpo eval`)."""
    from jgrpo.config import ModelConfig
    from jgrpo.export import evaluate

    return evaluate(
        cfg.replace(
            model=ModelConfig(path=str(folder), dtype="float32"),
            grpo=dataclasses.replace(cfg.grpo, val_num_generations=1, val_pass_at=(1,)),
        )
    )["val/accuracy"]


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
    """Build the warm-start folder `out` (atomically, replacing a stale one); returns its record."""
    from jgrpo.files import atomic_folder
    from jgrpo.models import save_pretrained
    from jgrpo.models.tiny import build_tiny_model
    from jgrpo.tasks import make_task

    # chat tasks (calculator) need builtin:tiny-qwen2-chat's tokenizer and tool-aware template
    chat = make_task(cfg.data, settings.data_seed, load_data=False).needs_chat_template
    with tempfile.TemporaryDirectory() as tmp:
        base = build_tiny_model(
            Path(tmp) / "base",
            seed=settings.init_seed,
            chat=chat,
            hidden_size=settings.hidden_size,
            num_hidden_layers=settings.num_layers,
            num_attention_heads=settings.num_heads,
            num_key_value_heads=settings.num_kv_heads,
            intermediate_size=settings.intermediate_size,
        )
        model, losses = train_sft(settings, base, cfg, log=log)
        with atomic_folder(out, overwrite=True) as folder:
            save_pretrained(model, folder, source=base)
            record = {
                "settings": dataclasses.asdict(settings),
                "key": settings.key(),
                "loss_first": round(float(losses[0]), 6),
                "loss_last": round(float(losses[-1]), 6),
                "loss_every_10": [round(float(x), 6) for x in losses[::10]],
            }
            if evaluate:
                record["val_accuracy"] = evaluate_folder(cfg, folder)
            (folder / SETTINGS_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return record


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
