"""notebooks/quickstart.ipynb runs top to bottom (nbclient + ipykernel, tiny settings): its CPU
path as `make test` executes it, and its GPU path (chosen by the runtime: the cells after the
one tagged `parameters`) on a CPU, forced on, against a loopback hub serving stand-ins for
Qwen2.5-0.5B-Instruct and GSM8K."""

import json
import shutil
from pathlib import Path

import pytest
from conftest import xla_flags
from hub_server import HubServer  # tests/ is on sys.path (rootdir conftest)
from test_api import CHAT_TEMPLATE
from test_hub import _env

from jgrpo.config import load_config
from jgrpo.models.tiny import build_tiny_model

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "quickstart.ipynb"


def gpu_cells(nb) -> list[str]:
    """The sources of the GPU path's code cells: the `parameters` cell and every one after it."""
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    start = next(i for i, c in enumerate(code) if "parameters" in c["metadata"].get("tags", []))
    return ["".join(c["source"]) for c in code[start:]]


def execute(nb, cwd: Path):
    nbclient = pytest.importorskip("nbclient")
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}
    )
    client.execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    images = sum(
        o.get("output_type") == "display_data" and "image/png" in o.get("data", {}) for o in outputs
    )
    return text, images


@pytest.mark.slow
def test_quickstart_notebook_runs(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    monkeypatch.setenv("JGRPO_NOTEBOOK_STEPS", "3")  # CI size; the notebook default is 40
    text, images = execute(nbformat.read(NOTEBOOK, as_version=4), tmp_path)
    final = tmp_path / "runs" / "quickstart" / "final"
    assert (final / "config.json").is_file()
    assert images >= 1  # the curves were drawn inline
    assert "trained model:" in text and "3+4=" in text
    assert "No GPU: the GPU path is skipped" in text  # the runtime chose the CPU path
    assert not (tmp_path / "runs" / "gsm8k_lora").exists()


def test_gpu_cells_skip_on_cpu_and_run_the_t4_recipe():
    """The GPU cells compile, run as a skip on this CPU runtime, and their overrides of the T4
    recipe validate and change no shape of its step: tests/test_recipes.py's sizing of
    configs/qwen25_0.5b_gsm8k_lora_t4.yaml (it fits 16 GB) is the sizing of the notebook's run."""
    cells = gpu_cells(json.loads(NOTEBOOK.read_text()))
    assert len(cells) == 3
    scope: dict = {}
    for source in cells:
        exec(compile(source, "gpu-cell", "exec"), scope)
    assert scope["ON_GPU"] is False and scope["GPU_OVERRIDES"] == []
    recipe = REPO / "configs" / scope["RECIPE"]
    assert recipe.name == "qwen25_0.5b_gsm8k_lora_t4.yaml"
    cfg, base = load_config(recipe, scope["gpu_overrides"]), load_config(recipe, [])
    assert cfg.grpo.max_num_steps == scope["GPU_STEPS"] == 50
    assert (cfg.model, cfg.rollout, cfg.mesh, cfg.loss, cfg.optim.learning_rate) == (
        base.model,
        base.rollout,
        base.mesh,
        base.loss,
        base.optim.learning_rate,
    )
    assert cfg.grpo.batch_size == base.grpo.batch_size == 32
    assert cfg.grpo.num_microbatches == base.grpo.num_microbatches
    assert cfg.model.path == "Qwen/Qwen2.5-0.5B-Instruct" and cfg.data.train_path == "openai/gsm8k"


GSM8K_RECORDS = [
    {"question": f"Tom has {a} apples and buys {b} more. How many now?", "answer": f"#### {a + b}"}
    for a in range(6)
    for b in range(5)
]


def gsm8k_stand_in() -> dict:
    """openai/gsm8k's layout: configs main and socratic, train and test splits of each."""
    lines = [json.dumps(r) for r in GSM8K_RECORDS]
    card = "---\nconfigs:\n" + "".join(
        f"- config_name: {c}\n  data_files:\n"
        + "".join(f"  - split: {sp}\n    path: {c}/{sp}.jsonl\n" for sp in ("train", "test"))
        for c in ("main", "socratic")
    )
    files = {"README.md": (card + "---\n# gsm8k stand-in\n").encode()}
    for c in ("main", "socratic"):
        files[f"{c}/train.jsonl"] = ("\n".join(lines[5:]) + "\n").encode()
        files[f"{c}/test.jsonl"] = ("\n".join(lines[:5]) + "\n").encode()
    return files


@pytest.mark.slow
@pytest.mark.heavy  # make test: test_gpu_cells_skip_on_cpu_and_run_the_t4_recipe
def test_notebook_gpu_path_runs_against_a_loopback_hub(tmp_path, monkeypatch):
    """The whole notebook with the GPU path forced on (a cell injected after `parameters`, as
    papermill does): the T4 recipe downloads its model and data by their hub ids (a tiny Qwen2
    with a chat template and a GSM8K-shaped dataset, served on 127.0.0.1), trains 2 steps with
    shorter completions, draws its curves and generates from the result."""
    nbformat = pytest.importorskip("nbformat")
    model = build_tiny_model(tmp_path / "stand-in")
    (model / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    repos = {
        ("model", "Qwen/Qwen2.5-0.5B-Instruct"): {p.name: p.read_bytes() for p in model.iterdir()},
        ("dataset", "openai/gsm8k"): gsm8k_stand_in(),
    }
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(REPO / "configs" / "qwen25_0.5b_gsm8k_lora_t4.yaml", work)  # as in a checkout
    nb = nbformat.read(NOTEBOOK, as_version=4)
    at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    forced = 'ON_GPU = True\nGPU_STEPS = 2\nGPU_OVERRIDES = ["rollout.max_new_tokens=24"]'
    nb.cells.insert(at + 1, nbformat.v4.new_code_cell(forced))
    monkeypatch.setenv("JGRPO_NOTEBOOK_STEPS", "2")
    with HubServer(repos) as server:
        for key, value in _env(tmp_path / "hf", server.endpoint).items():
            monkeypatch.setenv(key, value)
        # one device, as on a T4 (not the suite's 8 fake ones)
        monkeypatch.setenv("XLA_FLAGS", xla_flags(None))
        text, images = execute(nb, work)
        fetched = {r.rsplit("/", 1)[-1] for r in server.requests if "/resolve/" in r}
    assert {"config.json", "model.safetensors", "train.jsonl"} <= fetched
    run = work / "runs" / "gsm8k_lora"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 2
    saved = load_config(run / "config.yaml", [])
    assert saved.model.lora.rank == 16 and saved.model.compute_dtype == "float32"
    assert text.count("trained model:") == 2 and images >= 2  # both paths trained and drew
    assert "No GPU" not in text
