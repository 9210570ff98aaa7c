"""tools/warm_start.py on a tiny budget: same bytes twice, the loss falls, the cache is reused."""

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = (
    "--hidden-size 32 --num-layers 1 --intermediate-size 64 "
    "--steps 30 --batch-size 16 --warmup-steps 5 --no-eval"
).split()


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_same_bytes_twice_loss_falls_and_cache_is_reused(warm_start, tmp_path, capsys):
    config = str(ROOT / "configs" / "demo.yaml")
    a, b = tmp_path / "a", tmp_path / "b"
    assert warm_start.main(["--config", config, "--out", str(a), *TINY]) == 0
    assert warm_start.main(["--config", config, "--out", str(b), *TINY]) == 0
    files = folder_bytes(a)
    assert {"config.json", "model.safetensors", "tokenizer.json", "warm_start.json"} <= set(files)
    assert files == folder_bytes(b)

    record = json.loads(files["warm_start.json"])
    assert record["loss_last"] < 0.6 * record["loss_first"]
    assert record["settings"]["steps"] == 30

    capsys.readouterr()
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert warm_start.main(["--config", config, "--out", str(a), *TINY]) == 0
    assert "cached" in capsys.readouterr().out
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime

    # different settings: rebuilt in place, and the folder still loads as an HF model
    assert warm_start.main(["--config", config, "--out", str(a), *TINY, "--steps", "31"]) == 0
    assert "cached" not in capsys.readouterr().out
    assert json.loads((a / "warm_start.json").read_text())["settings"]["steps"] == 31
    from jgrpo.models import from_pretrained

    assert from_pretrained(a).cfg.hidden_size == 32
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folders left
