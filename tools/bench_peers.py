"""`make bench-peers`: jgrpo against TRL's GRPOTrainer and Tunix's GRPO, side by side.

One run, three shapes, each framework in its own process (started once per shape, kept warm),
one whole GRPO step at a time in interleaved rounds (jgrpo, jgrpo-fast, TRL, Tunix, then the
next round in rotated order), so the machine's load falls on every side alike. Medians per side
of the whole step (wall time from "go" to the step's end: sampling, reward, the train step,
the optimizer update and the side's own host work) and of its sampling, and each side's ratio to
jgrpo's:

  tiny             the tiny random Qwen2 of tools/bench.py (2 layers, d 128, vocab 264),
                   4 prompts x 4 generations, 32 prompt + 32 new tokens (no row stops);
  smollm2          SmolLM2-135M (30 layers, d 576, vocab 49152), the same batch and lengths;
  smollm2-skewed   SmolLM2-135M, 4 x 4 rows, 32 prompt tokens, completions capped at 128:
                   each new token is the EOS with probability 1/64, so most rows stop early
                   (median 44 tokens) and about one in seven runs to the cap.

Sides: `jgrpo` (the trainer with its defaults and the CPU configs' `model.remat: dots`),
`jgrpo-fast` (the same + rollout.compact_decode, rollout.shared_prefill and
grpo.sequence_packing: since these became the defaults the two sides run the same program;
`jgrpo-fast` stays so that an older checkout on PYTHONPATH measures both), `trl`
(trl.GRPOTrainer with its defaults), `tunix` (tunix's GrpoLearner on its own Llama3 / Qwen2
models, the vanilla rollout engine). The same for all:
the model folder (weights, tokenizer), the prompts (exactly 32 tokens each, no chat template),
the reward function (`checksum_reward`), temperature 1, top-p 1, no top-k, 4 generations per
prompt, float32, learning rate 1e-6, constant schedule, no KL term (beta 0: no reference
forward), one policy update per batch (TRL num_iterations 1, Tunix num_iterations 1, jgrpo
`loss.force_on_policy_ratio`: the ratio is 1 and no side runs a separate old-logprob forward).

How the stops are made identical (a property of the weights, not of any sampler's options): the
model folders are crafted from the real ones. Every embedding row is set to the same vector, so
every position of every prompt enters the layers with the same input; causal attention over
identical values returns that value, so the final hidden state h is the same at every position
and step (the layers still do all their matmuls). The LM head (untied) is then set to
outer(target, h) / |h|^2, which makes the logits exactly `target` (up to rounding): 0 for every
token, and for the EOS -30 (uniform: no row stops) or log(p (V - 1) / (1 - p)) with p = 1/64
(skewed: each draw stops with probability p, whatever the framework's sampler). The learning
rate (1e-6) keeps the distribution where it is over the bench's few steps. SmolLM2's layers keep
their real weights; its LM head is untied (+28M parameters in every side's update).

    python tools/bench_peers.py [--shapes tiny,smollm2,smollm2-skewed] [--rounds 3]
        [--sides jgrpo,jgrpo-fast,trl,tunix]

Memory: every side of a shape stays resident for its rounds; on SmolLM2 the peers hold
several times jgrpo's memory (docs/performance.md), so on a small machine run fewer --sides.

Needs the `peers` extra (TRL, Tunix's dependencies; `make bench-peers` installs it and
google-tunix itself, see the Makefile). Prints a table; saves JSON under runs/bench-peers/.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np

TOOLS = Path(__file__).resolve().parent
ROOT = TOOLS.parent
sys.path.insert(0, str(TOOLS))  # bench (machine limits, the tiny model's shape)

SHAPES = {
    # name: (source model, prompts, generations, prompt tokens, new-token cap, workload)
    "tiny": ("tiny", 4, 4, 32, 32, "uniform"),
    "smollm2": ("smollm2", 4, 4, 32, 32, "uniform"),
    "smollm2-skewed": ("smollm2", 4, 4, 32, 128, "skewed"),
}
STOP_PROBABILITY = 1 / 64
"""Skewed: the chance that a drawn token is the EOS."""
NEVER = -30.0
"""The EOS logit of the uniform workload (e^-30 / V: no row stops)."""
SIDES = ("jgrpo", "jgrpo-fast", "trl", "tunix")
FAST = ["rollout.compact_decode=true", "rollout.shared_prefill=true", "grpo.sequence_packing=true"]
"""jgrpo-fast's overrides on top of jgrpo's defaults."""
LEARNING_RATE = 1e-6
WARM_STEPS = 1
"""Untimed steps of every side before the rounds (compiles, caches)."""


def checksum_reward(prompts, completions, **kwargs):
    """The bench's reward, the same function for every side (TRL's and Tunix's signature):
    a cheap hash of the completion text in [0, 1], so groups have a spread."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [(sum(map(ord, t)) % 101) / 100 for t in texts]


# ------------------------------------------------------------------------ model and data
def source_folder(source: str, workdir: Path) -> Path:
    if source == "tiny":
        from bench import TINY_MODEL

        from jgrpo.models.tiny import build_tiny_model

        return build_tiny_model(workdir / "tiny-source", overwrite=True, **TINY_MODEL)
    from jgrpo.models.sources import resolve_model_path

    return Path(resolve_model_path(source))


def craft_folder(source: Path, out: Path, workload: str) -> dict:
    """`source`'s HF folder with constant embedding rows and an LM head that makes every
    logit 0 but the EOS's (module docstring). -> {"eos", "eos_logit", "max_logit_error"}."""
    import safetensors.numpy
    import torch
    from transformers import AutoModelForCausalLM

    config = json.loads((source / "config.json").read_text())
    weights = safetensors.numpy.load_file(str(source / "model.safetensors"))
    embed = weights["model.embed_tokens.weight"]
    vocab, _ = embed.shape
    weights["model.embed_tokens.weight"] = np.broadcast_to(embed.mean(0), embed.shape).copy()
    weights["lm_head.weight"] = np.zeros_like(embed)
    config["tie_word_embeddings"] = False
    eos = config["eos_token_id"]
    eos = eos[0] if isinstance(eos, list) else eos
    p = STOP_PROBABILITY
    eos_logit = math.log(p * (vocab - 1) / (1 - p)) if workload == "skewed" else NEVER
    target = np.zeros(vocab, np.float64)
    for special in {config.get("pad_token_id"), config.get("bos_token_id")} - {None, eos}:
        target[special] = NEVER  # never drawn: a drawn pad would read as padding to some sides
    target[eos] = eos_logit
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(source, out)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    safetensors.numpy.save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ids = torch.randint(3, vocab, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        h = model.model(input_ids=ids).last_hidden_state[0, -1].double().numpy()
    head = np.outer(target, h) / (h @ h)
    weights["lm_head.weight"] = head.astype(np.float32)
    safetensors.numpy.save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.double().numpy()
    error = float(np.abs(logits - target).max())
    if error > 1e-2:
        raise RuntimeError(f"{out}: crafted logits off by {error} (hidden state not constant)")
    return {"eos": eos, "eos_logit": eos_logit, "max_logit_error": error}


def make_prompts(folder: Path, count: int, tokens: int, seed: int = 0) -> list[str]:
    """`count` distinct strings of exactly `tokens` tokens under `folder`'s tokenizer (no
    special tokens added: every side tokenizes them alike)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    words = ["apple", "river", "stone", "cloud", "green", "seven", "house", "light", "table"]
    rng = np.random.RandomState(seed)
    prompts = []
    while len(prompts) < count:
        text = ""
        while len(tok(text, add_special_tokens=False).input_ids) < tokens:
            text += " " + words[rng.randint(len(words))]
        while len(tok(text, add_special_tokens=False).input_ids) > tokens:
            text = text[:-1]
        if len(tok(text, add_special_tokens=False).input_ids) == tokens and text not in prompts:
            prompts.append(text)
    full = tok(prompts[0]).input_ids
    if len(full) != tokens:
        raise RuntimeError(f"{folder}: the tokenizer adds special tokens ({len(full)} ids)")
    return prompts


# ------------------------------------------------------------------------ the sides
class Stop(Exception):
    """The parent ended the side (raised inside a framework's loop to leave it)."""


class Driver:
    """A side's end of the pipe: `wait()` blocks until the parent says go (raises Stop on
    close), `done(**timings)` reports the step."""

    def __init__(self, conn):
        self.conn, self.start, self.generation_s, self.lengths = conn, None, 0.0, []

    def wait(self) -> None:
        message = self.conn.recv()
        if message == "close":
            raise Stop
        self.generation_s, self.lengths = 0.0, []
        self.start = time.perf_counter()

    def done(self, length_mean=None, length_max=None) -> None:
        """Report the step (lengths: of `self.lengths`, the completions the side recorded,
        unless given)."""
        step_s = time.perf_counter() - self.start
        if length_mean is None and self.lengths:
            length_mean, length_max = np.mean(self.lengths), np.max(self.lengths)
        self.conn.send(
            {
                "step_s": step_s,
                "generation_s": self.generation_s,
                "length_mean": None if length_mean is None else float(length_mean),
                "length_max": None if length_max is None else float(length_max),
            }
        )


def serve(side: str, spec: dict, conn) -> None:
    """A side's process: build it, say "ready", then step on every "go" until "close"."""
    driver = Driver(conn)
    try:
        {"jgrpo": serve_jgrpo, "jgrpo-fast": serve_jgrpo, "trl": serve_trl, "tunix": serve_tunix}[
            side
        ](side, spec, driver)
    except Stop:
        pass
    except BaseException as e:
        import traceback

        conn.send({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
        raise
    finally:
        conn.close()


def serve_jgrpo(side: str, spec: dict, driver: Driver) -> None:
    from bench import Stepper

    from jgrpo.config import load_config

    overrides = [
        f"model.path={spec['folder']}",
        "model.remat=dots",
        "data.task=prompts",
        f"data.train_path={spec['prompts_file']}",
        "data.reward_functions=[{function: 'bench_peers:checksum_reward'}]",
        f"grpo.num_prompts_per_step={spec['prompts']}",
        f"grpo.num_generations_per_prompt={spec['generations']}",
        "grpo.max_num_steps=100000",
        "grpo.val_at_start=false",
        "grpo.val_at_end=false",
        "grpo.val_period=0",
        f"rollout.prompt_bucket={spec['prompt_tokens']}",
        f"rollout.max_new_tokens={spec['new_tokens']}",
        "rollout.temperature=1.0",
        f"optim.learning_rate={LEARNING_RATE}",
        "loss.force_on_policy_ratio=true",
        "checkpoint.save_period=0",
        "logging.tensorboard=false",
        "logging.progress_bar=false",
        "logging.plot=false",
        "mesh.data=1",
        *(FAST if side == "jgrpo-fast" else []),
    ]
    cfg = load_config(None, overrides)
    stepper = Stepper(cfg, Path(spec["workdir"]) / side)
    driver.conn.send("ready")
    try:
        while True:
            driver.wait()
            metrics = stepper()
            driver.generation_s = metrics["perf/generation_s"]
            driver.done(metrics["length/mean"], metrics["length/max"])
    finally:
        stepper.close()


def serve_trl(side: str, spec: dict, driver: Driver) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class Timed(GRPOTrainer):
        def _generate(self, prompts):
            start = time.perf_counter()
            out = super()._generate(prompts)
            driver.generation_s += time.perf_counter() - start
            driver.lengths += [len(ids) for ids in out[1]]  # completion_ids
            return out

    class Steps(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            driver.wait()

        def on_step_end(self, args, state, control, **kwargs):
            driver.done()

    torch.manual_seed(0)
    folder = spec["folder"]
    rows = spec["prompts"] * spec["generations"]
    args = GRPOConfig(
        output_dir=str(Path(spec["workdir"]) / side),
        per_device_train_batch_size=rows,
        num_generations=spec["generations"],
        max_completion_length=spec["new_tokens"],
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant",
        beta=0.0,
        num_iterations=1,
        # float32 like every side (TRL's default is bf16); no gradient checkpointing (its
        # default is on): at these sizes memory is plentiful and recomputing costs time
        bf16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        max_steps=10**6,
        logging_steps=10**6,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    prompts = json.loads(Path(spec["prompts_json"]).read_text())
    data = Dataset.from_list([{"prompt": p} for p in prompts] * 1000)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    trainer = Timed(
        model=model,
        reward_funcs=[checksum_reward],
        args=args,
        train_dataset=data,
        processing_class=AutoTokenizer.from_pretrained(folder, padding_side="left"),
        callbacks=[Steps()],
    )
    driver.conn.send("ready")
    trainer.train()


def tunix_model(spec: dict, mesh):
    """The crafted folder as Tunix's own model (Qwen2 for the tiny shape, Llama3 for
    SmolLM2), loaded by Tunix's safetensors loader."""
    config = json.loads((Path(spec["folder"]) / "config.json").read_text())
    fields = dict(
        num_layers=config["num_hidden_layers"],
        vocab_size=config["vocab_size"],
        embed_dim=config["hidden_size"],
        hidden_dim=config["intermediate_size"],
        num_heads=config["num_attention_heads"],
        head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        num_kv_heads=config["num_key_value_heads"],
        rope_theta=int(
            config.get("rope_theta") or config.get("rope_parameters", {}).get("rope_theta")
        ),
        norm_eps=config["rms_norm_eps"],
    )
    if config["model_type"] == "qwen2":
        from tunix.models.qwen2 import model as lib
        from tunix.models.qwen2 import params

        cfg = lib.ModelConfig(**fields, use_tied_embedding=False)
    else:
        from tunix.models.llama3 import model as lib
        from tunix.models.llama3 import params

        cfg = lib.ModelConfig(**fields, weight_tying=False)
    return params.create_model_from_safe_tensors(spec["folder"], cfg, mesh)


def serve_tunix(side: str, spec: dict, driver: Driver) -> None:
    import jax
    import optax
    from jax.sharding import AxisType
    from transformers import AutoTokenizer
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(AxisType.Auto,) * 2)
    model = tunix_model(spec, mesh)
    tokenizer = AutoTokenizer.from_pretrained(spec["folder"])
    role = rl_cluster_lib.Role
    cluster = rl_cluster_lib.RLCluster(
        actor=model,
        tokenizer=tokenizer,
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={role.ACTOR: mesh, role.REFERENCE: mesh, role.ROLLOUT: mesh},
            rollout_engine="vanilla",
            offload_to_cpu=False,
            training_config=rl_cluster_lib.RLTrainingConfig(
                actor_optimizer=optax.chain(
                    optax.clip_by_global_norm(1.0), optax.adamw(LEARNING_RATE, weight_decay=0.0)
                ),
                eval_every_n_steps=10**9,
                max_steps=10**6,
            ),
            rollout_config=base_rollout.RolloutConfig(
                max_tokens_to_generate=spec["new_tokens"],
                max_prompt_length=spec["prompt_tokens"],
                kv_cache_size=spec["prompt_tokens"] + spec["new_tokens"],
                temperature=1.0,
                top_p=1.0,
                top_k=None,
            ),
        ),
    )
    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster,
        reward_fns=[checksum_reward],
        algo_config=grpo_learner.GRPOConfig(
            num_generations=spec["generations"], num_iterations=1, beta=0.0, epsilon=0.2
        ),
    )
    generate = cluster.generate

    def timed_generate(*args, **kwargs):
        start = time.perf_counter()
        out = generate(*args, **kwargs)
        driver.generation_s += time.perf_counter() - start
        pad = cluster.rollout.pad_id()
        driver.lengths += [int(np.sum(np.asarray(t) != pad)) for t in out.tokens]
        return out

    cluster.generate = timed_generate
    # an array, not a list: Tunix maps np.repeat over the batch's leaves (a list's strings
    # would each become an array)
    bos = tokenizer.bos_token_id is not None
    prompts_file = Path(spec["prompts_json_bos" if bos else "prompts_json"])
    prompts = np.asarray(json.loads(prompts_file.read_text()))

    def batches():
        """One batch per step: a step ends when Tunix asks for the next batch."""
        driver.wait()
        while True:
            yield {"prompts": prompts}
            driver.done()
            driver.wait()

    driver.conn.send("ready")
    learner.train(batches())


# ------------------------------------------------------------------------ the run
class Side:
    """A side's process and its pipe."""

    def __init__(self, name: str, spec: dict):
        ctx = multiprocessing.get_context("spawn")
        self.name, (self.conn, child) = name, ctx.Pipe()
        self.process = ctx.Process(target=serve, args=(name, spec, child), daemon=True)
        self.process.start()
        child.close()
        self._expect("ready")

    def _expect(self, what=None):
        message = self.conn.recv()
        if isinstance(message, dict) and "error" in message:
            raise RuntimeError(f"{self.name}: {message['error']}\n{message['traceback']}")
        if what is not None and message != what:
            raise RuntimeError(f"{self.name}: expected {what!r}, got {message!r}")
        return message

    def step(self) -> dict:
        self.conn.send("go")
        return self._expect()

    def close(self) -> None:
        try:
            self.conn.send("close")
        except OSError:
            pass
        self.process.join(60)
        if self.process.is_alive():
            self.process.kill()


def bench_shape(shape: str, sides: list[str], rounds: int, steps: int, workdir: Path) -> dict:
    source, prompts, generations, prompt_tokens, new_tokens, workload = SHAPES[shape]
    folder = workdir / f"{source}-{workload}"
    if not (folder / "model.safetensors").exists():
        crafted = craft_folder(source_folder(source, workdir), folder, workload)
        (folder / "crafted.json").write_text(json.dumps(crafted))
    crafted = json.loads((folder / "crafted.json").read_text())
    texts = make_prompts(folder, prompts, prompt_tokens)
    lines = "".join(json.dumps({"prompt": t}) + "\n" for t in texts)
    (workdir / f"{shape}.jsonl").write_text(lines)
    (workdir / f"{shape}.json").write_text(json.dumps(texts))
    # Tunix's sampler prepends the tokenizer's BOS to every prompt (and pads a longer prompt
    # to the next power of 2): its prompts are one token shorter, so it too prefills 32
    shorter = make_prompts(folder, prompts, prompt_tokens - 1)
    (workdir / f"{shape}-bos.json").write_text(json.dumps(shorter))
    spec = dict(
        folder=str(folder),
        prompts_file=str(workdir / f"{shape}.jsonl"),
        prompts_json=str(workdir / f"{shape}.json"),
        prompts_json_bos=str(workdir / f"{shape}-bos.json"),
        prompts=prompts,
        generations=generations,
        prompt_tokens=prompt_tokens,
        new_tokens=new_tokens,
        workdir=str(workdir / shape),
    )
    print(f"\n== {shape}: starting {', '.join(sides)}", flush=True)
    running, first = {}, {}
    try:
        for name in sides:
            start = time.perf_counter()
            running[name] = Side(name, spec)
            first[name] = {"start_s": time.perf_counter() - start}
            first[name]["steps"] = [running[name].step() for _ in range(WARM_STEPS)]
            first_s = first[name]["steps"][0]["step_s"]
            print(f"  {name}: ready, first step {first_s:.2f} s", flush=True)
        records = {name: [] for name in sides}
        for r in range(rounds):
            order = sides[r % len(sides) :] + sides[: r % len(sides)]
            for name in order:
                records[name] += [running[name].step() for _ in range(steps)]
            print(
                f"  round {r + 1}/{rounds}: "
                + ", ".join(f"{n} {records[n][-1]['step_s']:.2f} s" for n in sides),
                flush=True,
            )
    finally:
        for side in running.values():
            side.close()
    out = {
        "model": source,
        "rows": prompts * generations,
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "workload": workload,
        "crafted": crafted,
        "sides": {},
    }
    for name, rows in records.items():
        out["sides"][name] = {
            "step_s": statistics.median(r["step_s"] for r in rows),
            "generation_s": statistics.median(r["generation_s"] for r in rows),
            "length_mean": statistics.mean(r["length_mean"] for r in rows if r["length_mean"]),
            "steps": rows,
            "first": first[name],
        }
    return out


def print_report(report: dict) -> None:
    print(
        f"\nmachine: {report['cpu']}, {report['cores']} cores, AVX-512 {report['avx512']}; "
        f"float32 matmul {report['machine']['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s, memory "
        f"read {report['machine']['memory_read_bytes_per_s'] / 1e9:.1f} GB/s; load average "
        f"{report['load_before']} before, {report['load_after']} after"
    )
    for shape, r in report["shapes"].items():
        sides = r["sides"]
        base = sides.get("jgrpo-fast") or sides.get("jgrpo")
        print(
            f"\n== {shape}: {r['model']}, {r['rows']} rows, {r['prompt_tokens']} + "
            f"{r['new_tokens']} tokens ({r['workload']}); medians of {len(base['steps'])} steps"
        )
        print(
            f"{'side':12s}{'step s':>10s}{'sampling s':>12s}{'rest s':>10s}{'mean len':>10s}"
            f"{'vs jgrpo':>10s}{'vs fast':>10s}"
        )
        for name, s in sides.items():
            j = sides.get("jgrpo")
            print(
                f"{name:12s}{s['step_s']:10.3f}{s['generation_s']:12.3f}"
                f"{s['step_s'] - s['generation_s']:10.3f}{s['length_mean']:10.1f}"
                + (f"{s['step_s'] / j['step_s']:9.2f}x" if j else f"{'-':>10s}")
                + (f"{s['step_s'] / base['step_s']:9.2f}x" if base else "")
            )


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma list of " + ",".join(SHAPES))
    ap.add_argument("--sides", default=",".join(SIDES), help="comma list of " + ",".join(SIDES))
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--steps", type=int, default=None, help="steps a side a round (tiny 3, else 1)")
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench-peers"), help="folder for the JSON")
    args = ap.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    sides = [s for s in args.sides.split(",") if s]
    for name, chosen, allowed in (("--shapes", shapes, SHAPES), ("--sides", sides, SIDES)):
        if set(chosen) - set(allowed):
            unknown = sorted(set(chosen) - set(allowed))
            ap.error(f"{name}: unknown {unknown}; allowed {list(allowed)}")
    # the sides' reward child processes import this file as `bench_peers`
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(TOOLS), str(ROOT), os.environ.get("PYTHONPATH")])
    )
    from bench_limits import machine_limits

    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    report = {
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpu": next(
            (x.split(":", 1)[1].strip() for x in cpuinfo.splitlines() if "model name" in x),
            platform.machine(),
        ),
        "cores": len(os.sched_getaffinity(0)),
        "avx512": "avx512" in cpuinfo,
        "load_before": os.getloadavg()[0],
        "machine": machine_limits(5),
        "shapes": {},
    }
    workdir = Path(args.out) / "work"
    workdir.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    for shape in shapes:
        steps = args.steps or (3 if shape == "tiny" else 1)
        report["shapes"][shape] = bench_shape(shape, sides, args.rounds, steps, workdir)
        report["load_after"] = os.getloadavg()[0]
        text = json.dumps(report, indent=2, default=str)  # after each shape: a crash keeps it
        (out / f"{report['time_utc'].replace(':', '')}.json").write_text(text)
        (out / "latest.json").write_text(text)
    print_report(report)
    print(f"\nsaved {out / 'latest.json'}")
    return report


if __name__ == "__main__":
    main()
