"""Careless users and damaged files through the real CLI: exit 2, one line, no traceback, fast.

Every case runs `python -m jgrpo.cli ...` in a subprocess (all of them in parallel, once per
module) against a folder of damaged artefacts built here: bad YAML, out-of-range values,
damaged model folders, datasets folders with damaged JSON, generated tasks too small to hold
out a validation set, run folders that are files or hold someone's files, torn metrics, broken
GGUF files, export targets that are not empty. Each must exit 2 with exactly one
`jgrpo: error:` line on stderr naming the key or file, and no traceback. Cases marked jax-free
must be rejected before jax is even imported (what makes a rejected start take < 1 s).
The cases of test_cli.BAD_INPUTS are replayed here too, out of process.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from test_cli import BAD_INPUTS  # tests/ is on sys.path (rootdir conftest)

from jgrpo.cli import run_folder_kind
from jgrpo.config import load_config, to_dict
from jgrpo.models.tiny import build_tiny_model

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")

# Runs the CLI and reports on stdout whether jax was imported by the time it returned.
_RUNNER = (
    "import sys\n"
    "from jgrpo.cli import main\n"
    "try:\n"
    "    code = main(sys.argv[1:])\n"
    "finally:\n"
    "    print('JAX_IMPORTED' if 'jax' in sys.modules else 'JAX_NOT_IMPORTED')\n"
    "sys.exit(code)\n"
)


def _json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj))


def _edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    _json(folder / "config.json", cfg)


def build_lab(lab: Path) -> None:
    """Every damaged artefact the cases point at."""
    # files of test_cli's bad_files fixture (its BAD_INPUTS refer to them as {tmp}/...)
    (lab / "broken.yaml").write_text("grpo: [unclosed\n")
    (lab / "list.yaml").write_text("- 1\n- 2\n")
    (lab / "wrong_fields.jsonl").write_text(json.dumps({"prompt": "1+1", "label": "2"}) + "\n")
    # YAML files
    (lab / "binary.yaml").write_bytes(bytes(range(256)) * 4)
    (lab / "latin1.yaml").write_bytes(b"data:\n  system_prompt: caf\xe9\n")
    (lab / "nul.yaml").write_bytes(b"grpo:\n  seed: 1\x00\n")
    (lab / "dup.yaml").write_text("grpo:\n  seed: 1\n  max_num_steps: 2\n  seed: 2\n")
    (lab / "dup_top.yaml").write_text("grpo:\n  seed: 1\nloss: {}\ngrpo:\n  seed: 2\n")
    (lab / "config_folder.yaml").mkdir()

    # model folders: a good tiny model, then one damaged copy per case
    models = lab / "models"
    good = build_tiny_model(models / "good")

    def damaged(name: str) -> Path:
        folder = models / name
        shutil.copytree(good, folder)
        return folder

    (damaged("cfg_garbage") / "config.json").write_text("{not json")
    _json(damaged("cfg_list") / "config.json", [1, 2, 3])
    (damaged("cfg_binary") / "config.json").write_bytes(b"\xff\xfe\x00garbage")
    _edit_config(damaged("cfg_no_vocab"), vocab_size=None)
    _edit_config(damaged("cfg_heads"), num_key_value_heads=3)
    _edit_config(damaged("gpt2_no_weights"), model_type="gpt2")  # the family is named first
    (models / "gpt2_no_weights" / "model.safetensors").unlink()
    weights = good / "model.safetensors"
    data = weights.read_bytes()
    (damaged("st_truncated") / "model.safetensors").write_bytes(data[: len(data) // 2])
    (damaged("st_garbage") / "model.safetensors").write_bytes(os.urandom(4096))
    (damaged("st_three_bytes") / "model.safetensors").write_bytes(b"abc")
    (damaged("st_header") / "model.safetensors").write_bytes((64).to_bytes(8, "little") + b"x" * 80)
    _edit_config(damaged("shape_layers"), num_hidden_layers=3)
    _edit_config(damaged("shape_mlp"), intermediate_size=96)
    folder = damaged("index_missing_shard")
    (folder / "model.safetensors").unlink()
    _json(
        folder / "model.safetensors.index.json",
        {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}},
    )
    (damaged("index_garbage") / "model.safetensors.index.json").write_text("[]")
    (damaged("no_tokenizer") / "tokenizer.json").unlink()
    (damaged("tok_garbage") / "tokenizer.json").write_text("this is not a tokenizer")
    from tokenizers import Tokenizer
    from tokenizers import models as tok_models

    Tokenizer(tok_models.BPE(vocab={}, merges=[])).save(str(damaged("tok_zero") / "tokenizer.json"))
    _edit_config(damaged("short_context"), max_position_embeddings=16)
    for name in (
        "generation_config.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
    ):
        (damaged(f"json_{name.split('.')[0]}") / name).write_text("{not json")
    (damaged("index_not_json") / "model.safetensors.index.json").write_text("{not json")

    # datasets save_to_disk folders, each with one damaged JSON file
    import datasets

    records = [{"question": f"{i}+1", "answer": str(i + 1)} for i in range(8)]
    table = datasets.Dataset.from_list(records)
    good_dict = lab / "datasets" / "good_dict"
    datasets.DatasetDict({"train": table, "test": table}).save_to_disk(str(good_dict))
    for name, file, content in [
        ("dict_garbage", "dataset_dict.json", b"{not json"),
        ("dict_list", "dataset_dict.json", b"[1, 2]"),
        ("dict_no_splits", "dataset_dict.json", b'{"splits": 3}'),
        ("state_garbage", "train/state.json", b"{not json"),
        ("info_garbage", "train/dataset_info.json", b"{not json"),
        ("info_binary", "train/dataset_info.json", b"\xff\xfe\x00garbage"),
    ]:
        shutil.copytree(good_dict, lab / "datasets" / name)
        (lab / "datasets" / name / file).write_bytes(content)

    # run folders
    runs = lab / "runs"
    (runs / "foreign").mkdir(parents=True)
    (runs / "foreign" / "notes.txt").write_text("someone's notes")
    (runs / "a_file").write_text("a file")
    saved = to_dict(load_config(TINY))
    for name in ("saved", "no_ckpt"):
        (runs / name).mkdir()
        (runs / name / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    (runs / "saved" / "checkpoints").mkdir()
    (runs / "bad_config" / "checkpoints").mkdir(parents=True)
    (runs / "bad_config" / "config.yaml").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    shutil.copytree(runs / "saved", runs / "damaged_step")
    (runs / "damaged_step" / "checkpoints" / "3" / "state").mkdir(parents=True)
    (lab / "export_out").mkdir()
    (lab / "export_out" / "model.safetensors.index.json").write_text("{}")

    # metrics files for plot
    plots = {
        "plot_binary": os.urandom(300) + b"\n" + os.urandom(300) + b"\n",
        "plot_torn": b'{"step": 1, "loss": 1.0}\n{"step": 2, "lo\n{"step": 3, "loss": 0.5}\n',
        "plot_stepless": b'{"loss": 1.0}\n{"loss": 2.0}\n',
        "plot_non_numeric": b'{"step": 1, "loss": "abc"}\n{"step": 2, "loss": 1.0}\n',
        "plot_empty": b"",
    }
    for name, content in plots.items():
        (lab / name).mkdir()
        (lab / name / "metrics.jsonl").write_bytes(content)
    (lab / "plot_missing").mkdir()

    # GGUF files
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(lab / "gpt2.gguf"), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    whole = (lab / "gpt2.gguf").read_bytes()
    (lab / "truncated.gguf").write_bytes(whole[: len(whole) // 2])
    (lab / "garbage.gguf").write_bytes(b"GGUF" + os.urandom(2000))
    (lab / "gguf_out").mkdir()
    (lab / "gguf_out" / "keep.txt").write_text("keep")


T = ["train", "--config", TINY]
M = "model.path={lab}/models/"
D = "data.train_path={lab}/datasets/"

# (id, argv ({lab} = the lab folder), what the one line must contain, jax-free?)
CASES = [
    # YAML files
    ("yaml-binary", ["train", "--config", "{lab}/binary.yaml"], "not UTF-8", True),
    ("yaml-latin1", ["train", "--config", "{lab}/latin1.yaml"], "not UTF-8", True),
    ("yaml-nul", ["train", "--config", "{lab}/nul.yaml"], "not valid YAML", True),
    ("yaml-duplicate", ["train", "--config", "{lab}/dup.yaml"], "duplicate key 'seed'", True),
    ("yaml-duplicate-top", ["train", "--config", "{lab}/dup_top.yaml"], "duplicate key", True),
    ("yaml-folder", ["train", "--config", "{lab}/config_folder.yaml"], "is a folder", True),
    # values validation let through before
    ("seed-negative", [*T, "grpo.seed=-1"], "grpo.seed", True),
    ("seed-huge", [*T, "grpo.seed=4294967296"], "grpo.seed", True),
    ("max-operand-huge", [*T, "data.max_operand=1000000000000"], "data.max_operand", True),
    ("num-terms-huge", [*T, "data.num_terms=100000"], "data.num_terms", True),
    ("prompt-bucket-huge", [*T, "rollout.prompt_bucket=100000000"], "rollout.prompt_bucket", True),
    ("max-new-huge", [*T, "rollout.max_new_tokens=100000000"], "rollout.max_new_tokens", True),
    (
        "sequence-sum-huge",
        [*T, "rollout.prompt_bucket=100000", "rollout.max_new_tokens=100000"],
        "rollout.prompt_bucket + rollout.max_new_tokens",
        True,
    ),
    (
        "prompts-huge",
        [*T, "grpo.num_prompts_per_step=100000000"],
        "grpo.num_prompts_per_step",
        True,
    ),
    (
        "batch-rows-huge",
        [*T, "grpo.num_prompts_per_step=65536", "grpo.num_generations_per_prompt=2"],
        "rows",
        True,
    ),
    (
        "batch-tokens-huge",
        [*T, "grpo.num_prompts_per_step=4096", "rollout.max_new_tokens=100000"],
        "tokens",
        True,
    ),
    ("val-examples-huge", [*T, "data.num_val_examples=1000000000"], "data.num_val_examples", True),
    (
        "beyond-max-position",
        [*T, "rollout.max_new_tokens=3000"],
        "max_position_embeddings 2048",
        True,
    ),
    # mesh.rules
    ("rules-not-pairs", [*T, "mesh.rules=[embed]"], "mesh.rules[0]", True),
    ("rules-one-item", [*T, "mesh.rules=[[embed]]"], "mesh.rules[0]", True),
    ("rules-three-items", [*T, "mesh.rules=[[embed, fsdp, x]]"], "mesh.rules[0]", True),
    ("rules-scalar", [*T, "mesh.rules=5"], "mesh.rules", True),
    ("rules-axis-number", [*T, "mesh.rules=[[embed, 3]]"], "mesh.rules[0][1]", True),
    ("rules-unknown-logical", [*T, "mesh.rules=[[nope, fsdp]]"], "mesh.rules", False),
    ("rules-unknown-axis", [*T, "mesh.rules=[[embed, nope]]"], "mesh.rules", False),
    # model folders
    ("model-config-garbage", [*T, M + "cfg_garbage"], "config.json' is not valid JSON", True),
    ("model-config-list", [*T, M + "cfg_list"], "JSON object", True),
    ("model-config-binary", [*T, M + "cfg_binary"], "not UTF-8", True),
    ("model-config-no-vocab", [*T, M + "cfg_no_vocab"], "vocab_size", True),
    ("model-config-heads", [*T, M + "cfg_heads"], "num_key_value_heads", True),
    ("model-type-first", [*T, M + "gpt2_no_weights"], "'gpt2' is not supported", True),
    ("model-st-truncated", [*T, M + "st_truncated"], "is truncated", True),
    ("model-st-garbage", [*T, M + "st_garbage"], "model.safetensors", True),
    ("model-st-3-bytes", [*T, M + "st_three_bytes"], "is truncated", True),
    ("model-st-header", [*T, M + "st_header"], "damaged safetensors header", True),
    ("model-shape-layers", [*T, M + "shape_layers"], "model.layers.2", True),
    ("model-shape-mlp", [*T, M + "shape_mlp"], "config.json implies", True),
    ("model-index-shard", [*T, M + "index_missing_shard"], "does not exist", True),
    ("model-index-garbage", [*T, M + "index_garbage"], "weight_map", True),
    ("model-no-tokenizer", [*T, M + "no_tokenizer"], "no tokenizer", True),
    ("model-tokenizer-garbage", [*T, M + "tok_garbage"], "does not load as a tokenizer", True),
    ("model-tokenizer-zero", [*T, M + "tok_zero"], "zero tokens", True),
    ("model-short-context", [*T, M + "short_context"], "max_position_embeddings 16", True),
    (
        "model-generation-config-garbage",
        [*T, M + "json_generation_config"],
        "generation_config.json' is not valid JSON",
        True,
    ),
    (
        "model-tokenizer-config-garbage",
        [*T, M + "json_tokenizer_config"],
        "tokenizer_config.json' is not valid JSON",
        True,
    ),
    (
        "model-special-tokens-garbage",
        [*T, M + "json_special_tokens_map"],
        "special_tokens_map.json' is not valid JSON",
        True,
    ),
    (
        "model-added-tokens-garbage",
        [*T, M + "json_added_tokens"],
        "added_tokens.json' is not valid JSON",
        True,
    ),
    ("model-index-not-json", [*T, M + "index_not_json"], "index.json' is not valid JSON", True),
    # datasets folders (data.train_path) with a damaged JSON file
    (
        "data-dict-garbage",
        [*T, "data.task=gsm8k", D + "dict_garbage"],
        "dataset_dict.json' is not valid JSON",
        True,
    ),
    ("data-dict-list", [*T, "data.task=gsm8k", D + "dict_list"], "must hold a JSON object", True),
    ("data-dict-no-splits", [*T, "data.task=gsm8k", D + "dict_no_splits"], "'splits' list", True),
    (
        "data-state-garbage",
        [*T, "data.task=gsm8k", D + "state_garbage"],
        "state.json' is not valid JSON",
        True,
    ),
    (
        "data-info-garbage",
        [*T, "data.task=gsm8k", D + "info_garbage"],
        "dataset_info.json' is not valid JSON",
        True,
    ),
    (
        "data-info-binary",
        [*T, "data.task=gsm8k", D + "info_binary"],
        "dataset_info.json' is not UTF-8",
        True,
    ),
    (
        "data-val-dict-garbage",
        [*T, "data.val_path={lab}/datasets/dict_garbage"],
        "data.val_path: ",
        True,
    ),
    # generated tasks with fewer than 2 distinct questions (nothing to hold out)
    (
        "arithmetic-one-question",
        [*T, "data.max_operand=0", "data.operators=+", "data.num_terms=1", "grpo.max_num_steps=1"],
        "data.max_operand=0, data.num_terms=1, data.operators='+', data.min_operand=0: the "
        "arithmetic task has 1 distinct question",
        True,
    ),
    (
        "countdown-one-question",
        [*T, "data.task=countdown", "data.max_operand=1", "data.countdown_num_numbers=4"],
        "data.max_operand=1, data.countdown_num_numbers=4: the countdown task has 1 distinct",
        True,
    ),
    # run folders and flags
    ("run-dir-file", [*T, "--run-dir", "{lab}/runs/a_file"], "is a file", True),
    ("run-dir-under-file", [*T, "--run-dir", "{lab}/runs/a_file/run"], "lies under", True),
    ("run-dir-foreign", [*T, "--run-dir", "{lab}/runs/foreign"], "not a jgrpo run", True),
    (
        "fresh-foreign",
        [*T, "--run-dir", "{lab}/runs/foreign", "--fresh"],
        "--fresh deletes only run folders",
        True,
    ),
    (
        "resume-and-fresh",
        [*T, "--run-dir", "{lab}/runs/saved", "--resume", "--fresh"],
        "--resume and --fresh",
        True,
    ),
    ("run-dir-unwritable", [*T, "--run-dir", "/proc/jgrpo-run"], "--run-dir", False),
    # resume
    ("resume-no-ckpt", [*T, "--run-dir", "{lab}/runs/no_ckpt", "--resume"], "checkpoints/", True),
    (
        "resume-seed",
        [*T, "--run-dir", "{lab}/runs/saved", "--resume", "grpo.seed=5"],
        "grpo.seed: 0 -> 5",
        True,
    ),
    (
        "resume-model",
        [*T, "--run-dir", "{lab}/runs/saved", "--resume", M + "good"],
        "model.path",
        True,
    ),
    (
        "resume-config-garbage",
        [*T, "--run-dir", "{lab}/runs/bad_config", "--resume"],
        "config.yaml' is not UTF-8",
        True,
    ),
    (
        "resume-no-intact-checkpoint",
        [*T, "--run-dir", "{lab}/runs/damaged_step", "--resume"],
        "no intact checkpoint",
        False,
    ),
    # plot
    ("plot-binary", ["plot", "{lab}/plot_binary"], "line 1", True),
    ("plot-torn", ["plot", "{lab}/plot_torn"], "line 2", True),
    ("plot-stepless", ["plot", "{lab}/plot_stepless"], "line 1", True),
    ("plot-non-numeric", ["plot", "{lab}/plot_non_numeric"], "line 1", True),
    ("plot-empty", ["plot", "{lab}/plot_empty"], "no metrics lines", True),
    ("plot-missing", ["plot", "{lab}/plot_missing"], "has no metrics.jsonl", True),
    # convert-gguf
    ("gguf-missing", ["convert-gguf", "{lab}/nothing.gguf", "{lab}/o1"], "does not exist", True),
    (
        "gguf-truncated",
        ["convert-gguf", "{lab}/truncated.gguf", "{lab}/o2"],
        "truncated.gguf",
        True,
    ),
    (
        "gguf-garbage",
        ["convert-gguf", "{lab}/garbage.gguf", "{lab}/o3"],
        "not a readable GGUF",
        True,
    ),
    ("gguf-not-llama", ["convert-gguf", "{lab}/gpt2.gguf", "{lab}/o4"], "'gpt2'", True),
    ("gguf-out-exists", ["convert-gguf", "{lab}/gpt2.gguf", "{lab}/gguf_out"], "not empty", True),
    # export / eval
    ("export-out-not-empty", ["export", "{lab}/runs/saved", "{lab}/export_out"], "not empty", True),
    ("export-not-a-run", ["export", "{lab}/runs/foreign", "{lab}/e1"], "not a run folder", True),
    (
        "export-no-checkpoint",
        ["export", "{lab}/runs/saved", "{lab}/e2"],
        "no complete checkpoint",
        True,
    ),
    ("export-config-garbage", ["export", "{lab}/runs/bad_config", "{lab}/e3"], "not UTF-8", True),
    (
        "export-damaged-step",
        ["export", "{lab}/runs/damaged_step/checkpoints/3", "{lab}/e4"],
        "damaged",
        False,
    ),
    (
        "export-under-file",
        ["export", "{lab}/runs/saved", "{lab}/runs/a_file/out"],
        "lies under",
        True,
    ),
    (
        "eval-not-a-run",
        ["eval", "--config", TINY, "--checkpoint", "{lab}/runs/foreign"],
        "not a run folder",
        True,
    ),
    (
        "inspect-config-garbage",
        ["inspect-step", "--config", TINY, M + "cfg_garbage", "--no-compile"],
        "not valid JSON",
        False,
    ),
    (
        "inspect-config-list",
        ["inspect-step", "--config", TINY, M + "cfg_list", "--no-compile"],
        "JSON object",
        False,
    ),
    # rollout.ray_address that refuses connections
    (
        "ray-unreachable",
        [*T, "rollout.backend=ray", "rollout.ray_address=127.0.0.1:1"],
        "127.0.0.1:1",
        False,
    ),
]

# test_cli's in-process cases, replayed out of process (the mesh/data ones need jax or data).
for i, (argv, needle) in enumerate(BAD_INPUTS):
    argv = [a.replace("{tmp}", "{lab}") for a in argv]
    full = ["train", *argv] if argv[0] == "--config" else [*T, *argv]
    jax_free = not any(
        a.startswith(("mesh.", "grpo.num_minibatches", "grpo.num_prompts_per_step=3")) for a in argv
    )
    CASES.append((f"cli{i}-{needle}", full, needle.replace("{tmp}", "{lab}"), jax_free))


def _run(lab: Path, argv: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    argv = [a.replace("{lab}", str(lab)) for a in argv]
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", _RUNNER, *argv],
        capture_output=True,
        text=True,
        cwd=lab,
        timeout=180,
    )
    return proc, time.perf_counter() - start


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lab")
    build_lab(folder)
    return folder


def _run_all(lab: Path, cases) -> dict:
    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        futures = {case[0]: pool.submit(_run, lab, case[1]) for case in cases}
        by_name = {name: f.result() for name, f in futures.items()}
    walls = sorted((round(w, 1), name) for name, (_, w) in by_name.items())
    print("hardening wall seconds (slowest 5):", walls[-5:])
    return by_name


JAX_FREE = [c for c in CASES if c[3]]
NEED_JAX = [c for c in CASES if not c[3]]


@pytest.fixture(scope="module")
def results(lab):
    return _run_all(lab, JAX_FREE)


@pytest.fixture(scope="module")
def results_jax(lab):
    return _run_all(lab, NEED_JAX)


def test_at_least_sixty_cases():
    assert len({c[0] for c in CASES}) == len(CASES) >= 60
    assert len(JAX_FREE) >= 60


PROGRESS = re.compile(r"jgrpo: (run folder|loading the (model|checkpoint)|placed it on) ")
"""The progress lines a run prints before the checks that need its model (a checkpoint)."""


def _check(proc, wall_s, needle, limit_s):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert all(PROGRESS.match(line) for line in lines[:-1]), proc.stderr[-3000:]
    assert lines[-1].startswith("jgrpo: error: "), proc.stderr[-3000:]
    assert needle in lines[-1], lines[-1]
    assert wall_s < limit_s


@pytest.mark.parametrize("name,argv,needle,jax_free", JAX_FREE, ids=[c[0] for c in JAX_FREE])
def test_case_exits_2_before_jax(lab, results, name, argv, needle, jax_free):
    proc, wall_s = results[name]
    _check(proc, wall_s, needle.replace("{lab}", str(lab)), 60)
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "JAX_NOT_IMPORTED" in proc.stdout, "rejected only after importing jax"


@pytest.mark.slow  # each imports jax (device count, orbax, ray): ~5 s alone, more in parallel
@pytest.mark.parametrize("name,argv,needle,jax_free", NEED_JAX, ids=[c[0] for c in NEED_JAX])
def test_case_exits_2(lab, results_jax, name, argv, needle, jax_free):
    proc, wall_s = results_jax[name]
    _check(proc, wall_s, needle.replace("{lab}", str(lab)), 170)


def test_nothing_was_touched(lab, results):
    assert (lab / "runs" / "foreign" / "notes.txt").read_text() == "someone's notes"
    assert sorted(p.name for p in (lab / "runs" / "foreign").iterdir()) == ["notes.txt"]
    assert (lab / "gguf_out" / "keep.txt").read_text() == "keep"
    assert [p.name for p in (lab / "export_out").iterdir()] == ["model.safetensors.index.json"]
    assert not any((lab / name).exists() for name in ("o1", "o2", "o3", "o4", "e1", "e2", "e3"))
    assert not (lab / "runs" / "saved" / ".jgrpo-run").exists()


def test_fresh_refuses_a_folder_that_is_not_a_run(tmp_path):
    from jgrpo import cli

    home = tmp_path / "home"
    (home / "docs").mkdir(parents=True)
    (home / "docs" / "thesis.tex").write_text("years of work")
    (home / "config.yaml").write_text("mine: true\n")  # looks like a run file, is not only that
    code = cli.main(["train", "--config", TINY, "--run-dir", str(home), "--fresh"])
    assert code == 2
    assert (home / "docs" / "thesis.tex").read_text() == "years of work"
    assert (home / "config.yaml").read_text() == "mine: true\n"
    assert run_folder_kind(home) == "foreign:docs"
    # what a run folder is: only names a run writes, and a run file among them
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("")
    assert run_folder_kind(run) == "run"
    (run / "tb").mkdir()
    assert run_folder_kind(run) == "run"
    (run / "tb" / "anything").write_text("")  # inside known entries: still a run
    assert run_folder_kind(run) == "run"
    (run / "x.txt").write_text("")
    assert run_folder_kind(run) == "foreign:x.txt"
    only_tb = tmp_path / "only_tb"
    (only_tb / "tb").mkdir(parents=True)
    assert run_folder_kind(only_tb) == "foreign:tb"
    assert run_folder_kind(tmp_path / "absent") == "absent"


def test_documented_mesh_rules_load():
    cfg = load_config(TINY, ["mesh.rules=[[embed, null]]"])
    assert cfg.mesh.rules == (("embed", None),)
    cfg = load_config(TINY, ["mesh.rules=[[embed, null], [mlp, fsdp]]"])
    assert cfg.mesh.rules == (("embed", None), ("mlp", "fsdp"))
    from jgrpo.sharding import make_rules

    assert make_rules(cfg.mesh)["embed"] is None and make_rules(cfg.mesh)["mlp"] == "fsdp"


def test_torn_middle_line_is_dropped_on_resume_and_named(tmp_path):
    from jgrpo.metrics import truncate_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_bytes(
        b'{"step": 1, "loss": 1.0}\n{"step": 2, "lo\n\xff\xfe\n{"step": 3, "loss": 0.5}\n'
        b'{"step": 4, "loss": 0.25}\n{"step": 5, "lo'
    )
    with pytest.warns(UserWarning, match=r"dropped 3 damaged line\(s\) \(line 2, 3, 6\)"):
        kept = truncate_metrics(path, 3)
    assert kept == [{"step": 1, "loss": 1.0}, {"step": 3, "loss": 0.5}]
    assert path.read_text() == '{"step": 1, "loss": 1.0}\n{"step": 3, "loss": 0.5}\n'


def test_resume_may_change_only_the_listed_keys():
    from jgrpo.config import ConfigError, check_resume_compatible

    saved = to_dict(load_config(TINY))
    allowed = [
        "grpo.max_num_steps=9",
        "logging.plot=true",
        "checkpoint.save_period=5",
        "mesh.data=2",
    ]
    check_resume_compatible(saved, load_config(TINY, allowed))
    for override, key in [
        ("grpo.seed=1", "grpo.seed"),
        ("model.path=/elsewhere", "model.path"),
        ("optim.learning_rate=0.5", "optim.learning_rate"),
        ("rollout.temperature=0.5", "rollout.temperature"),
    ]:
        with pytest.raises(ConfigError, match=rf"{key}: .* -> ") as e:
            check_resume_compatible(saved, load_config(TINY, [*allowed, override]))
        assert "grpo.max_num_steps" in str(e.value) and "\n" not in str(e.value)


def test_smallest_generated_task_holds_out_one_question_and_trains_on_the_other(tmp_path):
    from jgrpo.config import ConfigError
    from jgrpo.tasks import make_task

    two = load_config(TINY, ["data.max_operand=1", "data.num_terms=1"]).data  # questions 0, 1
    task = make_task(two, seed=0)
    assert len(task.val) == 1  # half of the 2 distinct questions, not num_val_examples (16)
    held_out = task.val[0]["question"]
    drawn = {e["question"] for e in task.train.next_prompts(32)}
    assert drawn == {"0", "1"} - {held_out}
    one = load_config(TINY, ["data.max_operand=0", "data.num_terms=1"]).data
    with pytest.raises(ConfigError, match="has 1 distinct question"):
        make_task(one, seed=0)
    # with a validation file the held-out set comes from the file: one question trains
    val = tmp_path / "val.jsonl"
    val.write_text(json.dumps({"question": "3+4", "answer": "7"}) + "\n")
    task = make_task(dataclasses.replace(one, val_path=str(val)), seed=0)
    assert [e["question"] for e in task.val] == ["3+4"]
    assert {e["question"] for e in task.train.next_prompts(4)} == {"0"}
