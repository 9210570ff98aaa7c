"""`jgrpo sft`: the SFT step's loss and gradient against transformers' PyTorch forward in float64
with the NLL in float64 NumPy (and TRL's SFTTrainer when it is importable), packed = unpacked =
microbatched, the rollout's layout of conversations (tool turns masked), config errors (exit 2)
and a CLI run with final/, resume and export."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
import transformers

from jgrpo import inspect_step, step
from jgrpo.config import ConfigError, load_config
from jgrpo.models import load_policy
from jgrpo.models.tiny import build_tiny_model
from jgrpo.rollout import load_tokenizer
from jgrpo.rollout.conversation import ChatFormat, tool_message
from jgrpo.sft import step_config
from jgrpo.sft_data import Encoder, encode_table, make_batch
from jgrpo.step_setup import build_step

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
T = 32
RECORDS = [
    {"prompt": f"{a}+{b}=", "completion": str(a + b)}
    for a, b in [(1, 2), (34, 5), (7, 88), (12, 12), (9, 0), (55, 44), (3, 3), (60, 1)]
]
"""Eight prompt/completion records of different lengths (one batch)."""
CALL = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "3*4"}}}
CONVERSATION = [
    {"role": "system", "content": "Use the tool."},
    {"role": "user", "content": "What is 3*4?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    tool_message("calculator", "12"),
    {"role": "assistant", "content": "The answer is 12."},
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft-models")
    bare = build_tiny_model(root / "bare", seed=3, hidden_size=48, intermediate_size=96)
    chat = build_tiny_model(root / "chat", seed=4, chat=True, hidden_size=48, intermediate_size=96)
    return {"bare": bare, "chat": chat}


def sft_cfg(folder, *overrides):
    return load_config(
        TINY,
        [
            f"model.path={folder}",
            "model.compute_dtype=float32",
            "model.remat=none",
            "sft.batch_size=8",
            f"sft.max_seq_length={T}",
            "optim.learning_rate=1e-3",
            *overrides,
        ],
    )


T_CHAT = 192
"""Row length of the conversations (the char tokenizer spends a token per byte)."""


def encoded(cfg, records):
    tokenizer = load_tokenizer(cfg.model.path)
    enc = Encoder(tokenizer, cfg)
    return encode_table(records, enc, cfg.sft.max_seq_length, "records"), tokenizer


def sft_step(cfg, examples, pad_id):
    """(metrics, params after) of one SFT step from the model's own weights."""
    model = load_policy(cfg.model, seed=0)
    built = build_step(step_config(cfg), model, objective="sft")
    batch = make_batch(examples, cfg.sft.batch_size, cfg.sft.max_seq_length, pad_id)
    state, metrics = built.step_fn(
        built.state, built.device_batch(batch), built.hparams, None, built.frozen
    )
    return {k: float(v) for k, v in jax.device_get(metrics).items()}, jax.device_get(state.params)


def torch_reference(folder, examples):
    """(loss, gradient norm): transformers' forward in float64, the NLL of the target tokens
    in float64 NumPy, summed over the batch and divided by its target-token count; the gradient
    norm from torch's float64 autograd of the same loss."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    total, count, torch_total = 0.0, 0, 0.0
    for ids, mask in examples:  # one unpadded row at a time
        logits = model(torch.tensor([ids])).logits[0, :-1]
        lp = torch.log_softmax(logits, dim=-1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        m = np.asarray(mask[1:], np.float64)
        logits_np = logits.detach().numpy()
        shifted = logits_np - logits_np.max(-1, keepdims=True)
        lse = np.log(np.exp(shifted).sum(-1)) + logits_np.max(-1)
        picked = logits_np[np.arange(len(ids) - 1), ids[1:]] - lse
        total -= float((picked * m).sum())
        count += int(m.sum())
        torch_total = torch_total - (lp * torch.tensor(m)).sum()
    (torch_total / count).backward()
    norm = float(torch.sqrt(sum((p.grad**2).sum() for p in model.parameters())))
    return total / count, norm


def test_loss_and_gradient_equal_transformers_float64(folders):
    cfg = sft_cfg(folders["bare"])
    examples, tokenizer = encoded(cfg, RECORDS)
    # prompt ids ++ completion ids ++ EOS, the completion and EOS the targets
    ids, mask = examples[1]
    want = tokenizer("34+5=", add_special_tokens=False)["input_ids"]
    assert ids[: len(want)] == want and not any(mask[: len(want)])
    assert ids[len(want) :] == tokenizer("39", add_special_tokens=False)["input_ids"] + [
        tokenizer.eos_token_id
    ]
    assert all(mask[len(want) :])
    metrics, _ = sft_step(cfg, examples, tokenizer.pad_token_id)
    loss, norm = torch_reference(folders["bare"], examples)
    assert metrics["loss/total"] == pytest.approx(loss, abs=1e-5, rel=1e-5)
    assert metrics["loss/nll"] == metrics["loss/total"]
    assert metrics["batch/num_valid_tokens"] == sum(sum(m) for _, m in examples)
    assert metrics["train/grad_norm"] == pytest.approx(norm, rel=1e-4)
    assert norm > 0.1


def test_conversation_loss_counts_assistant_tokens_only(folders):
    cfg = sft_cfg(folders["chat"], f"sft.max_seq_length={T_CHAT}")
    convs = [{"messages": CONVERSATION[i % 2 :]} for i in range(8)]  # with and without system
    examples, tokenizer = encoded(cfg, convs)
    chat = ChatFormat(tokenizer, [tokenizer.eos_token_id])
    for (ids, mask), record in zip(examples, convs):
        assert (ids, mask) == chat.encode(record["messages"])  # the rollout's layout
        # the mask covers exactly the two assistant turns (call and answer, each through
        # <|im_end|>): the tool result and the prompts are context
        turns = [chat.assistant_ids(CONVERSATION[2]), chat.assistant_ids(CONVERSATION[4])]
        assert sum(mask) == sum(map(len, turns))
        assert [i for i, m in zip(ids, mask) if m] == turns[0] + turns[1]
    metrics, _ = sft_step(cfg, examples, tokenizer.pad_token_id)
    loss, norm = torch_reference(folders["chat"], examples)
    assert metrics["loss/total"] == pytest.approx(loss, abs=1e-5, rel=1e-5)
    assert metrics["train/grad_norm"] == pytest.approx(norm, rel=1e-4)


def sft_grads(cfg, examples, pad_id):
    """(float32 gradients, loss metrics) of the SFT step's loss at the model's own weights,
    through the step's own pieces (`prepare_batch`, `accumulate_gradients`): gradients, not
    updated parameters, since AdamW's first update g / (|g| + eps) turns the rounding of a
    near-zero gradient into a change of O(lr) (see tests/test_packing.py)."""
    model = load_policy(cfg.model, seed=0)
    built = build_step(step_config(cfg), model, objective="sft")
    flags, graphdef, hp = built.flags, built.graphdef, built.hparams
    rows, width = cfg.sft.batch_size, cfg.sft.max_seq_length
    batch = built.device_batch(make_batch(examples, rows, width, pad_id))

    @jax.jit
    def grads_of(state, batch):
        data, _ = step.prepare_batch(state, batch, hp, None, flags=flags, graphdef=graphdef)
        return step.accumulate_gradients(state.params, data, hp, flags=flags, graphdef=graphdef)

    grads, metrics = grads_of(built.state, batch)
    return jax.tree.map(np.asarray, grads), {k: float(v) for k, v in metrics.items()}


def assert_same_grads(got, want):
    (g1, m1), (g0, m0) = got, want
    assert m1.keys() == m0.keys()
    for key in m0:
        np.testing.assert_allclose(m1[key], m0[key], rtol=1e-6, atol=1e-6, err_msg=key)
    # every parameter tensor gets a real gradient
    assert all(np.abs(g).max() > 1e-4 for g in jax.tree.leaves(g0))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), g1, g0)


PACKED = ["sft.sequence_packing=true", "sft.packing_budget=64"]


def test_packed_step_equals_unpacked(folders):
    """The fast proof of packing: packed rows of 64 tokens give the unpacked loss and
    gradients."""
    cfg = sft_cfg(folders["bare"])
    examples, tokenizer = encoded(cfg, RECORDS)
    plain = sft_grads(cfg, examples, tokenizer.pad_token_id)
    assert_same_grads(sft_grads(sft_cfg(folders["bare"], *PACKED), examples, 0), plain)


@pytest.mark.heavy  # make test: test_packed_step_equals_unpacked
@pytest.mark.parametrize(
    "overrides", [["sft.num_microbatches=2"], [*PACKED, "sft.num_microbatches=2"]]
)
def test_microbatched_steps_equal_the_plain_step(folders, overrides):
    """16 rows: each of 2 microbatches splits over the 8 devices."""
    cfg = sft_cfg(folders["bare"], "sft.batch_size=16")
    examples, tokenizer = encoded(cfg, RECORDS * 2)
    plain = sft_grads(cfg, examples, tokenizer.pad_token_id)
    other = sft_cfg(folders["bare"], "sft.batch_size=16", *overrides)
    assert_same_grads(sft_grads(other, examples, 0), plain)


def test_sft_step_has_one_forward_and_no_advantages(folders):
    cfg = sft_cfg(folders["bare"])
    built = build_step(step_config(cfg), load_policy(cfg.model, abstract=True), objective="sft")
    assert not built.flags.compute_prev_logprobs and not built.flags.compute_ref_logprobs
    jaxpr = jax.make_jaxpr(built.step_fn)(*built.abstract_args())
    assert inspect_step.forwards_in_jaxpr(jaxpr) == ["policy"]


@pytest.mark.skipif(
    not os.environ.get("JGRPO_TRL_PATH"),
    reason="TRL's SFTTrainer: set JGRPO_TRL_PATH to a folder holding trl (docs/sft.md)",
)
def test_loss_equals_trl_sft_trainer(folders, tmp_path):
    """TRL's SFTTrainer (its tokenisation, collator and loss, float32 torch) on the same
    model and prompt/completion records, run in a subprocess with trl on its path."""
    cfg = sft_cfg(folders["bare"])
    examples, tokenizer = encoded(cfg, RECORDS)
    metrics, _ = sft_step(cfg, examples, tokenizer.pad_token_id)
    script = f"""
import json, torch, transformers
from datasets import Dataset
from trl import SFTConfig, SFTTrainer
folder = {str(folders["bare"])!r}
records = json.loads({json.dumps(json.dumps(RECORDS))})
model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
tok = transformers.AutoTokenizer.from_pretrained(folder)
args = SFTConfig(output_dir={str(tmp_path / "trl")!r}, per_device_train_batch_size=8,
                 max_length={T}, report_to=[], use_cpu=True, bf16=False)
trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(records),
                     processing_class=tok)
batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(records))])
with torch.no_grad():
    loss = trainer.compute_loss(model, batch)
rows = [[int(t) for t, l in zip(ids, lab) if l != -100] for ids, lab in
        zip(batch["input_ids"].tolist(), batch["labels"].tolist())]
print(json.dumps({{"loss": float(loss), "targets": rows}}))
"""
    env = {**os.environ, "PYTHONPATH": os.environ["JGRPO_TRL_PATH"]}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    trl = json.loads(out.stdout.strip().splitlines()[-1])
    # the same target tokens (completion ++ EOS), then the same loss
    assert trl["targets"] == [[i for i, m in zip(ids, mask) if m] for ids, mask in examples]
    assert metrics["loss/total"] == pytest.approx(trl["loss"], abs=1e-5, rel=1e-5)


def test_record_errors_name_the_record(folders):
    cfg = sft_cfg(folders["bare"], "sft.max_seq_length=7")
    tokenizer = load_tokenizer(folders["bare"])
    enc = Encoder(tokenizer, cfg)
    with pytest.raises(ConfigError, match=r"max_seq_length: records record 1 has 8 tokens, more"):
        encode_table([RECORDS[0], RECORDS[1]], enc, 7, "records")
    with pytest.raises(ConfigError, match="records record 0: has neither 'messages'"):
        encode_table([{"text": "hi"}], enc, 8, "records")
    with pytest.raises(ConfigError, match="no chat template"):
        encode_table([{"messages": CONVERSATION}], enc, 8, "records")


def run_cli(*args, cwd):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "jgrpo.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )


@pytest.mark.parametrize(
    "override, message",
    [
        ("sft.batch_size=0", "sft.batch_size: must be >= 1, got 0"),
        ("sft.max_seq_length=1", "sft.max_seq_length: must lie in [2, 131072], got 1"),
        ("sft.num_microbatches=3", "sft.num_microbatches: 3 must divide sft.batch_size = 32"),
        ("sft.packing_budget=64", "sft.packing_budget: set, but sft.sequence_packing is false"),
        ("sft.train_path=missing.jsonl", "sft.train_path: 'missing.jsonl' does not exist"),
    ],
)
def test_bad_sft_config_exits_2(tmp_path, override, message):
    out = run_cli(
        "sft", "--config", TINY, "--run-dir", str(tmp_path / "run"), override, cwd=tmp_path
    )
    assert out.returncode == 2, out.stderr
    assert message in out.stderr
    assert not (tmp_path / "run").exists()


def test_cli_sft_run_writes_final_and_validates(folders, tmp_path):
    """`jgrpo sft` on a JSONL file: 2 steps, validation loss on a val file, final/ loadable by
    transformers."""
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS[:3]))
    out = run_cli(
        "sft",
        "--config",
        TINY,
        "--run-dir",
        "run",
        f"model.path={folders['bare']}",
        "sft.train_path=train.jsonl",
        "sft.val_path=val.jsonl",
        "sft.batch_size=8",
        f"sft.max_seq_length={T}",
        "sft.max_num_steps=2",
        "sft.val_accuracy=false",
        "optim.learning_rate=1e-3",
        "logging.tensorboard=false",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2]
    assert lines[1]["val/loss"] < lines[0]["loss/total"]  # it learned within 2 steps
    assert "val/loss" in out.stdout
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")
    assert model.config.hidden_size == 48


@pytest.mark.heavy
def test_cli_sft_resume_repeats_the_run_and_exports(folders, tmp_path):
    """4 steps straight vs 2 + --resume 2 (checkpoint every 2): the same losses and weights;
    `jgrpo export` of the resumed run equals its final/."""
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    common = [
        f"model.path={folders['bare']}",
        "sft.train_path=train.jsonl",
        "sft.batch_size=8",
        f"sft.max_seq_length={T}",
        "sft.val_accuracy=false",
        "sft.val_period=0",
        "checkpoint.save_period=2",
        "optim.learning_rate=1e-3",
        "model.lora.rank=4",
        "logging.tensorboard=false",
    ]
    straight = run_cli(
        "sft", "--config", TINY, "--run-dir", "a", *common, "sft.max_num_steps=4", cwd=tmp_path
    )
    assert straight.returncode == 0, straight.stderr[-3000:]
    first = run_cli(
        "sft", "--config", TINY, "--run-dir", "b", *common, "sft.max_num_steps=2", cwd=tmp_path
    )
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = run_cli(
        "sft",
        "--config",
        TINY,
        "--run-dir",
        "b",
        "--resume",
        *common,
        "sft.max_num_steps=4",
        cwd=tmp_path,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    read = lambda run: [
        json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()
    ]
    assert [x["loss/total"] for x in read("a")] == pytest.approx(
        [x["loss/total"] for x in read("b")], rel=1e-6
    )
    export = run_cli("export", "b", "exported", cwd=tmp_path)
    assert export.returncode == 0, export.stderr[-3000:]
    for name in ("a/final", "exported"):
        a = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b" / "final").state_dict()
        b = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / name).state_dict()
        for key in a:
            np.testing.assert_allclose(a[key].numpy(), b[key].numpy(), atol=1e-6, err_msg=key)


def test_trl_sft_arguments_map_to_jgrpo_keys():
    from jgrpo.api import build_sft_config
    from jgrpo.trl_config import SFTConfig

    args = SFTConfig(
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_length=64,
        max_steps=7,
        packing=True,
        learning_rate=3e-4,
        lr_scheduler_type="cosine",
        bf16=True,
        assistant_only_loss=True,
        report_to="none",
    )
    cfg = build_sft_config(None, ["sft.val_period=3"], args=args, model="builtin:tiny-qwen2")
    s = cfg.sft
    assert (s.batch_size, s.num_microbatches, s.max_seq_length, s.max_num_steps) == (8, 2, 64, 7)
    assert s.sequence_packing and s.val_period == 3 and cfg.optim.schedule == "cosine"
    assert cfg.optim.learning_rate == 3e-4 and cfg.model.compute_dtype == "bfloat16"
    assert not cfg.logging.tensorboard and cfg.model.path == "builtin:tiny-qwen2"
    for kwargs, message in [
        ({"assistant_only_loss": False}, "SFTConfig.assistant_only_loss: False is not supported"),
        ({"num_train_epochs": 2}, "SFTConfig: num_train_epochs is not supported"),
        ({"per_device_train_batch_size": 0}, "per_device_train_batch_size: 0 must be a positive"),
        ({"beta": 0.1}, "SFTConfig: beta is not a TRL argument jgrpo supports"),
    ]:
        with pytest.raises(ConfigError, match=message):
            SFTConfig(**kwargs)


@pytest.mark.heavy  # make test: test_cli_sft_run_writes_final_and_validates
def test_sft_trainer_trains_on_python_records_with_lora(tmp_path):
    import jgrpo
    from jgrpo.config import LoRAConfig

    records = [{"messages": CONVERSATION[1:]} for _ in range(4)]
    trainer = jgrpo.SFTTrainer(
        model="builtin:tiny-qwen2-chat",
        train_dataset=records,
        eval_dataset=records[:2],
        args=jgrpo.SFTConfig(
            max_steps=2, per_device_train_batch_size=8, learning_rate=1e-2, max_length=T_CHAT
        ),
        peft_config=LoRAConfig(rank=4),
        run_dir=tmp_path / "run",
        overrides=["sft.val_accuracy=false", "model.remat=none", "logging.tensorboard=false"],
    )
    result = trainer.train()
    assert [r["step"] for r in result.history] == [2]
    assert result.history[0]["val/loss"] < result.metrics[0]["loss/total"]
    assert (result.model_dir / "model.safetensors").is_file()
