"""Reading record files and the deterministic, restorable order of training examples.

Formats (chosen by the path): `.jsonl` / `.ndjson` (one JSON object a line), `.json` (a list
of objects, or JSONL), `.parquet` / `.pq`, and a folder written by HF `Dataset.save_to_disk`
(`DatasetDict` folders: split `train` for data.train_path, `test` or `validation` for
data.val_path). Folders are read with `datasets.load_from_disk` when `datasets` is installed,
else directly from the Arrow stream files listed in the folder's `state.json` (the layout
`save_to_disk` writes; it always flattens index mappings, so the files are the rows in order).

Streams hand out examples with `next_prompts(n)` and carry a small JSON state:
- `RecordStream` (file data), state `{"kind": "records", "seed", "epoch", "offset",
  "num_records"}`: epoch e visits the records in `permutation(rng(seed, e))` order (or file order
  when data.shuffle is off), so every epoch reshuffles and no state beyond the position is needed.
- `SyntheticStream` (generated data), state `{"kind": "synthetic", "seed", "index"}`: example i
  is drawn from `rng(seed, i)`, an infinite stream with no epochs.
Restoring a state and calling `next_prompts` yields exactly what the uninterrupted stream would.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import numpy as np

from jgrpo.config import ConfigError

Example = dict[str, Any]
"""One prompt's data: JSON-able, picklable; the fields are listed in `jgrpo.tasks`."""


# ----------------------------------------------------------------------------- reading


def _read_jsonl(path: Path, key: str) -> list[dict]:
    records = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise ConfigError(f"{key}: {str(path)!r} line {lineno} is not valid JSON") from None
            if not isinstance(record, dict):
                raise ConfigError(f"{key}: {str(path)!r} line {lineno} is not a JSON object")
            records.append(record)
    return records


def _read_json(path: Path, key: str) -> list[dict]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return _read_jsonl(path, key)  # JSON Lines saved as .json
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise ConfigError(f"{key}: {str(path)!r} must hold a list of JSON objects")
    return data


def _read_parquet(path: Path, key: str) -> list[dict]:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for bad files
        raise ConfigError(
            f"{key}: cannot read Parquet file {str(path)!r} ({type(e).__name__})"
        ) from None


def _read_arrow_file(path: Path):
    import pyarrow as pa

    try:
        with pa.memory_map(str(path)) as source:
            return pa.ipc.open_stream(source).read_all()
    except pa.ArrowInvalid:
        with pa.memory_map(str(path)) as source:
            return pa.ipc.open_file(source).read_all()


def _read_hf_folder(path: Path, key: str, split: str) -> list[dict]:
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        wanted = ["train"] if split == "train" else ["test", "validation"]
        chosen = next((s for s in wanted if s in splits), None)
        if chosen is None:
            raise ConfigError(
                f"{key}: HF DatasetDict {str(path)!r} has splits {splits}; need one of {wanted} "
                "(or point at the split's folder)"
            )
        path = path / chosen
    if not (path / "state.json").is_file():
        raise ConfigError(
            f"{key}: {str(path)!r} is a folder but not an HF datasets folder (no state.json or "
            "dataset_dict.json); use a .jsonl / .parquet file or Dataset.save_to_disk output"
        )
    try:
        import datasets
    except ImportError:
        datasets = None
    if datasets is not None:
        return datasets.load_from_disk(str(path)).to_list()
    try:
        import pyarrow as pa

        state = json.loads((path / "state.json").read_text())
        tables = [_read_arrow_file(path / f["filename"]) for f in state["_data_files"]]
        return pa.concat_tables(tables).to_pylist() if tables else []
    except Exception as e:  # noqa: BLE001
        raise ConfigError(
            f"{key}: cannot read HF datasets folder {str(path)!r} without the `datasets` package "
            f"({type(e).__name__}: {e}); pip install datasets"
        ) from None


def read_records(path_str: str, key: str, split: str = "train") -> list[dict]:
    """All records of a data file or HF datasets folder; ConfigError naming `key` on failure."""
    path = Path(path_str).expanduser()
    if not path.exists():
        raise ConfigError(f"{key}: {path_str!r} does not exist")
    if path.is_dir():
        records = _read_hf_folder(path, key, split)
    else:
        suffix = path.suffix.lower()
        readers = {
            ".jsonl": _read_jsonl,
            ".ndjson": _read_jsonl,
            ".json": _read_json,
            ".parquet": _read_parquet,
            ".pq": _read_parquet,
        }
        if suffix not in readers:
            raise ConfigError(
                f"{key}: unsupported format {suffix or path.name!r} of {path_str!r}; use "
                ".jsonl, .json, .parquet or an HF datasets folder"
            )
        try:
            records = readers[suffix](path, key)
        except UnicodeDecodeError:
            raise ConfigError(f"{key}: {path_str!r} is not UTF-8 text") from None
    if not records:
        raise ConfigError(f"{key}: {path_str!r} holds no records")
    return records


# ----------------------------------------------------------------------------- streams


def _rng(*words: int) -> np.random.Generator:
    return np.random.default_rng([int(w) for w in words])


class RecordStream:
    """Epoch-wise (re)shuffled pass over a fixed list of examples; restorable."""

    def __init__(self, examples: list[Example], seed: int, shuffle: bool):
        if not examples:
            raise ValueError("RecordStream needs at least one example")
        self.examples = examples
        self.seed = int(seed)
        self.shuffle = shuffle
        self._epoch, self._offset = 0, 0
        self._order = self._order_of(0)

    def _order_of(self, epoch: int) -> np.ndarray:
        n = len(self.examples)
        return _rng(self.seed, epoch).permutation(n) if self.shuffle else np.arange(n)

    @property
    def epoch(self) -> int:
        """Completed passes over the data."""
        return self._epoch

    def next_prompts(self, n: int) -> list[Example]:
        """The next `n` examples, continuing into the next (reshuffled) epoch as needed."""
        out = []
        while len(out) < n:
            take = min(n - len(out), len(self._order) - self._offset)
            out.extend(self.examples[i] for i in self._order[self._offset : self._offset + take])
            self._offset += take
            if self._offset == len(self._order):
                self._epoch, self._offset = self._epoch + 1, 0
                self._order = self._order_of(self._epoch)
        return out

    def state(self) -> dict:
        return {
            "kind": "records",
            "seed": self.seed,
            "epoch": self._epoch,
            "offset": self._offset,
            "num_records": len(self.examples),
        }

    def restore(self, state: dict) -> None:
        expected = {"kind": "records", "seed": self.seed, "num_records": len(self.examples)}
        mismatch = {k: state.get(k) for k, v in expected.items() if state.get(k) != v}
        if mismatch:
            raise ValueError(f"data order state {mismatch} does not match this stream {expected}")
        self._epoch, self._offset = int(state["epoch"]), int(state["offset"])
        self._order = self._order_of(self._epoch)


class SyntheticStream:
    """Infinite stream where example i is `generate(rng(seed, i), i)`; restorable by index."""

    def __init__(self, generate: Callable[[np.random.Generator, int], Example], seed: int):
        self.generate = generate
        self.seed = int(seed)
        self._index = 0

    @property
    def epoch(self) -> int:
        return 0

    def next_prompts(self, n: int) -> list[Example]:
        out = [self.generate(_rng(self.seed, i), i) for i in range(self._index, self._index + n)]
        self._index += n
        return out

    def state(self) -> dict:
        return {"kind": "synthetic", "seed": self.seed, "index": self._index}

    def restore(self, state: dict) -> None:
        if state.get("kind") != "synthetic" or state.get("seed") != self.seed:
            raise ValueError(
                f"data order state {state} does not match this stream (synthetic, seed {self.seed})"
            )
        self._index = int(state["index"])


def split_indices(num_records: int, num_val: int, split_seed: Optional[int] = 0):
    """(train, val) index arrays of a seeded split; val holds min(num_val, num_records // 2)."""
    order = _rng(split_seed, 1_000_003).permutation(num_records)
    num_val = min(num_val, num_records // 2)
    return np.sort(order[num_val:]), np.sort(order[:num_val])
