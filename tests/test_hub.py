"""Hub ids download through the real huggingface_hub code, against a loopback hub.

`hub_server.HubServer` serves a tiny model and a tiny dataset on 127.0.0.1 the way the hub
does; each case runs jgrpo in a subprocess with `HF_ENDPOINT` pointing at it, a fresh
`HF_HOME` and `HF_HUB_OFFLINE=0` (huggingface_hub reads both at import: a subprocess is the
honest way). First run: `jgrpo train` downloads model + data and trains a step; second run:
the server is stopped and the same ids come from the cache. Failures (missing, gated, login,
server down, a cut download, offline and uncached) are one `jgrpo: error:` line, exit 2.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from hub_server import COMMIT, HubServer  # tests/ is on sys.path (rootdir conftest)

from jgrpo import hub
from jgrpo.models.tiny import build_tiny_model

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")
MODEL, DATA, TWO = "tiny-org/tiny-qwen2", "tiny-org/arith", "tiny-org/two-configs"
RECORDS = [{"question": f"{a}+{b}", "answer": str(a + b)} for a in range(5) for b in range(4)]
DECOYS = ("pytorch_model.bin", "onnx/model.onnx", "original/consolidated.pth")

# the CLI's checks and the model lookup, without training (what a second start does first)
_PREFLIGHT = (
    "import sys\n"
    "from jgrpo.cli import _check_model_and_data\n"
    "from jgrpo.config import load_config\n"
    "from jgrpo.models.sources import resolve_model_path\n"
    "from jgrpo.tasks import make_task\n"
    "cfg = load_config(sys.argv[1], sys.argv[2:])\n"
    "_check_model_and_data(cfg)\n"
    "print('FOLDER', resolve_model_path(cfg.model.path))\n"
    "print('VAL', len(make_task(cfg.data, 0).val))\n"
)


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    folder = build_tiny_model(tmp_path_factory.mktemp("model") / "tiny")
    model = {p.name: p.read_bytes() for p in folder.iterdir()}
    model |= {name: b"not for jgrpo" for name in DECOYS}
    lines = [json.dumps(r) for r in RECORDS]
    data = {
        "data/train.jsonl": ("\n".join(lines[4:]) + "\n").encode(),
        "data/test.jsonl": ("\n".join(lines[:4]) + "\n").encode(),
        "README.md": b"# tiny arithmetic\n",
        "extra/notes.bin": b"not for jgrpo",
    }
    card = "---\nconfigs:\n" + "".join(
        f"- config_name: {c}\n  data_files:\n"
        + "".join(f"  - split: {sp}\n    path: {c}/{sp}.jsonl\n" for sp in ("train", "test"))
        for c in ("main", "socratic")
    )
    two = {"README.md": (card + "---\n# two configs\n").encode()}
    for c, n_test in (("main", 3), ("socratic", 5)):
        two[f"{c}/train.jsonl"] = ("\n".join(lines[n_test:]) + "\n").encode()
        two[f"{c}/test.jsonl"] = ("\n".join(lines[:n_test]) + "\n").encode()
    return {("model", MODEL): model, ("dataset", DATA): data, ("dataset", TWO): two}


def _env(home: Path, endpoint: str, offline: str = "0") -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    return env | {
        "HF_HOME": str(home),
        "HF_ENDPOINT": endpoint,
        "HF_HUB_OFFLINE": offline,
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_XET": "1",
        "HF_TOKEN": "",
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
        "JGRPO_CACHE": str(home / "jgrpo"),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }


def _run(env: dict, argv: list[str], cwd: Path, timeout: int = 300):
    return subprocess.run(
        [sys.executable, *argv], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def _train(env, cwd, *overrides):
    argv = ["-m", "jgrpo.cli", "train", "--config", TINY, "--run-dir", str(cwd / "run")]
    return _run(env, [*argv, "grpo.max_num_steps=1", *overrides], cwd)


def _one_error_line(proc, *needles) -> str:
    errors = [line for line in proc.stderr.splitlines() if line.startswith("jgrpo: error: ")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(errors) == 1, proc.stderr[-3000:]
    print(errors[0])
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_download_then_cache_hit_with_the_server_stopped(repos, tmp_path):
    home = tmp_path / "hf"
    ids = [f"model.path={MODEL}", f"data.train_path={DATA}", f"data.val_path={DATA}"]
    with HubServer(repos) as server:
        proc = _run(_env(home, server.endpoint), ["-c", _PREFLIGHT, TINY, *ids], tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        fetched = [r for r in server.requests if "/resolve/" in r]
    assert "Fetching 5 files" in proc.stderr  # huggingface_hub's progress bar
    names = {r.rsplit("/", 1)[-1] for r in fetched}
    assert {"config.json", "model.safetensors", "tokenizer.json", "train.jsonl"} <= names
    assert not any(d.rsplit("/", 1)[-1] in names for d in DECOYS), fetched  # allow_patterns
    assert "notes.bin" not in names
    assert sum("/revision/" in r for r in server.requests) == 2  # once per id per process
    snapshot = home / "hub" / "models--tiny-org--tiny-qwen2" / "snapshots" / COMMIT
    assert f"FOLDER {snapshot}" in proc.stdout
    assert "VAL 4" in proc.stdout  # data/test.jsonl's 4 records
    # the same ids again, the server gone: every file comes from the cache
    proc = _run(_env(home, server.endpoint), ["-c", _PREFLIGHT, TINY, *ids], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"FOLDER {snapshot}" in proc.stdout and "VAL 4" in proc.stdout
    # and offline (HF_HUB_OFFLINE=1): the cache-only lookup finds the same snapshot
    proc = _run(_env(home, server.endpoint, "1"), ["-c", _PREFLIGHT, TINY, *ids], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"FOLDER {snapshot}" in proc.stdout


@pytest.mark.slow  # one tiny training step in a subprocess (jax import + compile)
@pytest.mark.heavy  # in make test: the download, cache-hit and error tests
def test_jgrpo_train_downloads_and_trains_a_step(repos, tmp_path):
    ids = [f"model.path={MODEL}", f"data.train_path={DATA}"]
    with HubServer(repos) as server:
        proc = _train(_env(tmp_path / "hf", server.endpoint), tmp_path, *ids)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows and rows[-1]["step"] == 1


def _preflight_error(env, tmp_path, *overrides):
    return _train(env, tmp_path, *overrides)


@pytest.mark.parametrize(
    "fail,needles",
    [
        (None, ["model.path: 'tiny-org/nothing'", "does not exist"]),
        ("gated", ["model.path: model 'tiny-org/tiny-qwen2' is gated"]),
        ("login", ["model.path: 'tiny-org/tiny-qwen2'", "needs a login"]),
    ],
    ids=["missing", "gated", "login"],
)
def test_missing_gated_and_login_repos_are_one_line(repos, tmp_path, fail, needles):
    model = "tiny-org/nothing" if fail is None else MODEL
    with HubServer(repos, fail={MODEL: fail} if fail else None) as server:
        proc = _preflight_error(
            _env(tmp_path / "hf", server.endpoint), tmp_path, f"model.path={model}"
        )
    _one_error_line(proc, *needles)
    assert not (tmp_path / "run").exists()


def test_missing_dataset_is_one_line(repos, tmp_path):
    with HubServer(repos) as server:
        proc = _preflight_error(
            _env(tmp_path / "hf", server.endpoint), tmp_path, "data.train_path=tiny-org/none"
        )
    _one_error_line(proc, "data.train_path: 'tiny-org/none'", "dataset repo", "does not exist")


def test_server_down_names_the_id(tmp_path):
    endpoint = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    proc = _preflight_error(_env(tmp_path / "hf", endpoint), tmp_path, f"model.path={MODEL}")
    _one_error_line(proc, f"model.path: {MODEL!r} is not a local path", f"model from {endpoint}")


def test_a_cut_download_is_one_line_and_leaves_no_snapshot(repos, tmp_path):
    home = tmp_path / "hf"
    with HubServer(repos, truncate="model.safetensors") as server:
        proc = _preflight_error(_env(home, server.endpoint), tmp_path, f"model.path={MODEL}")
    _one_error_line(proc, f"model.path: downloading model {MODEL!r}")
    # the next start (server back, whole file) completes the download
    with HubServer(repos) as server:
        proc = _run(
            _env(home, server.endpoint), ["-c", _PREFLIGHT, TINY, f"model.path={MODEL}"], tmp_path
        )
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_offline_and_not_cached_keeps_the_cache_only_message(repos, tmp_path):
    with HubServer(repos) as server:
        proc = _preflight_error(
            _env(tmp_path / "hf", server.endpoint, "1"), tmp_path, f"model.path={MODEL}"
        )
        assert server.requests == []  # offline: not one request
    _one_error_line(proc, "not a model in the local Hugging Face cache", "HF_HUB_OFFLINE")


def test_offline_lookup_reads_the_env_at_call_time(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    assert not hub.offline()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub.offline()
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert hub.cache_dir() == str(tmp_path / "hub")
    assert hub.fetch(MODEL, "model", "model.path") is None  # offline, not cached


def test_a_dataset_with_two_configs_needs_data_dataset_config(repos, tmp_path):
    env_home = tmp_path / "hf"
    ids = [f"data.train_path={TWO}", f"data.val_path={TWO}"]
    with HubServer(repos) as server:
        env = _env(env_home, server.endpoint)
        proc = _train(env, tmp_path, *ids)
        _one_error_line(proc, f"data.dataset_config: data.train_path {TWO!r} has configs")
        proc = _train(env, tmp_path, *ids, "data.dataset_config=nope")
        _one_error_line(proc, "data.dataset_config: 'nope' is not a config of")
        for config, n_val in (("main", 3), ("socratic", 5)):
            argv = ["-c", _PREFLIGHT, TINY, *ids, f"data.dataset_config={config}"]
            proc = _run(env, argv, tmp_path)
            assert proc.returncode == 0, proc.stderr[-3000:]
            assert f"VAL {n_val}" in proc.stdout  # that config's test split
