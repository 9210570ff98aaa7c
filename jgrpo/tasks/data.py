"""Datasets of records and the deterministic, restorable order of training examples.

Sources (`load_table(spec, key, split)`, always through the `datasets` library, imported only
when file data is used): a file by suffix (`.jsonl` / `.ndjson` / `.json`, `.parquet` / `.pq`,
`.csv`; `datasets.load_dataset` converts it once into a memory-mapped Arrow file), a
`save_to_disk` folder (`DatasetDict`: split `train` for data.train_path, `test` or `validation`
for data.val_path), or a hub dataset id (`jgrpo.hub.fetch`, same split rule). Python data (the
`jgrpo.GRPOTrainer` API): a list of dicts or a `datasets.Dataset`.
Nothing is read into a Python list: `Rows` indexes the Arrow table; null values in a required
field are found up front with Arrow's null counts (`first_null`), before any model loads.
Streams hand out examples with `next_prompts(n)` and carry a small JSON state: `RecordStream`
(`{"kind": "records", "seed", "epoch", "offset", "num_records"}`: epoch e in
`permutation(rng(seed, e))` order, or file order without data.shuffle) and `SyntheticStream`
(`{"kind": "synthetic", "seed", "index"}`: example i from `rng(seed, i)`, no epochs).
Restoring a state and calling `next_prompts` yields exactly what the uninterrupted stream would."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Optional

import numpy as np

from jgrpo import hub
from jgrpo.config import ConfigError, read_json

Example = dict[str, Any]
"""One prompt's data: JSON-able, picklable; the fields are listed in `jgrpo.tasks`."""

Table = Any
"""A `datasets.Dataset` or a list of dicts: `len(t)`, `t[i] -> dict`."""

_BUILDERS = {
    ".jsonl": "json",
    ".ndjson": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".csv": "csv",
}


# ----------------------------------------------------------------------------- reading


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[Any]:
    """Import `datasets` with its progress bars and info logs off for the duration."""
    import datasets
    from datasets.utils import logging as ds_logging

    was_enabled = datasets.is_progress_bar_enabled()
    level = ds_logging.get_verbosity()
    datasets.disable_progress_bars()
    ds_logging.set_verbosity_error()
    try:
        yield datasets
    finally:
        ds_logging.set_verbosity(level)
        if was_enabled:
            datasets.enable_progress_bars()


def _diagnose_json(path: Path, key: str) -> None:
    """Raise naming the first line of a JSON file that is not a JSON object (after a failed load;
    returns when it finds nothing wrong)."""
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    if data is not None:
        if not isinstance(data, (list, dict)) or (
            isinstance(data, list) and not all(isinstance(r, dict) for r in data)
        ):
            raise ConfigError(f"{key}: {str(path)!r} must hold a list of JSON objects")
        return
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise ConfigError(f"{key}: {str(path)!r} line {lineno} is not valid JSON") from None
        if not isinstance(record, dict):
            raise ConfigError(f"{key}: {str(path)!r} line {lineno} is not a JSON object")


def _load_file(path: Path, key: str):
    suffix = path.suffix.lower()
    if suffix not in _BUILDERS:
        raise ConfigError(
            f"{key}: unsupported format {suffix or path.name!r} of {str(path)!r}; use "
            ".jsonl, .json, .parquet, .csv, a datasets folder or a cached HF dataset id"
        )
    builder = _BUILDERS[suffix]
    with _quiet_datasets() as datasets:
        try:
            return datasets.load_dataset(builder, data_files=str(path), split="train")
        except Exception as e:  # noqa: BLE001 - the builders raise many types for bad files
            detail = " ".join(f"{type(e).__name__}: {e}".split())[:200]
    try:  # name the line or the encoding when we can
        if builder == "json":
            _diagnose_json(path, key)
        elif builder == "csv":
            path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{key}: {str(path)!r} is not UTF-8 text") from None
    raise ConfigError(f"{key}: cannot read {str(path)!r} ({detail})")


def _pick_split(splits: Sequence[str], split: str, where: str, key: str) -> str:
    wanted = ["train"] if split == "train" else ["test", "validation"]
    chosen = next((s for s in wanted if s in splits), None)
    if chosen is None:
        raise ConfigError(
            f"{key}: {where} has splits {list(splits)}; need one of {wanted} "
            "(or point at the split's folder)"
        )
    return chosen


def _load_folder(path: Path, key: str, split: str):
    if (path / "dataset_dict.json").is_file():
        splits = read_json(path / "dataset_dict.json", key).get("splits")
        if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
            raise ConfigError(
                f"{key}: {str(path / 'dataset_dict.json')!r} has no 'splits' list of names"
            )
        path = path / _pick_split(splits, split, f"HF DatasetDict {str(path)!r}", key)
    if not (path / "state.json").is_file():
        raise ConfigError(
            f"{key}: {str(path)!r} is a folder but not an HF datasets folder (no state.json or "
            "dataset_dict.json); use a .jsonl / .parquet / .csv file or Dataset.save_to_disk output"
        )
    for name in ("state.json", "dataset_info.json"):  # load_from_disk would raise bare errors
        if name == "state.json" or (path / name).is_file():
            read_json(path / name, key)
    with _quiet_datasets() as datasets:
        try:
            return datasets.load_from_disk(str(path))
        except Exception as e:  # noqa: BLE001
            detail = " ".join(f"{type(e).__name__}: {e}".split())[:200]
            raise ConfigError(
                f"{key}: cannot read HF datasets folder {str(path)!r} ({detail})"
            ) from None


def _load_hub(repo_id: str, key: str, split: str, config: Optional[str]):
    folder = hub.fetch(repo_id, "dataset", key)
    if folder is None:
        raise ConfigError(
            f"{key}: {repo_id!r} is neither a file or folder nor a dataset in the local "
            "Hugging Face cache (HF_HUB_OFFLINE is set; download it first, e.g. `hf download "
            f"--repo-type dataset {repo_id}`)"
        )
    if (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file():
        return _load_folder(folder, key, split)
    with _quiet_datasets() as datasets:
        try:
            configs = list(datasets.get_dataset_config_names(str(folder)))
            if config is None and len(configs) > 1:
                raise ConfigError(
                    f"data.dataset_config: {key} {repo_id!r} has configs {configs}; choose one"
                )
            if config is not None and config not in configs:
                raise ConfigError(
                    f"data.dataset_config: {config!r} is not a config of {repo_id!r} ({key}); "
                    f"it has {configs}"
                )
            splits = list(datasets.get_dataset_split_names(str(folder), config))
            chosen = _pick_split(splits, split, f"HF dataset {repo_id!r}", key)
            return datasets.load_dataset(str(folder), config, split=chosen)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001
            detail = " ".join(f"{type(e).__name__}: {e}".split())[:200]
            raise ConfigError(
                f"{key}: cannot read cached HF dataset {repo_id!r} ({detail})"
            ) from None


def load_table(spec: str, key: str, split: str = "train", config: Optional[str] = None):
    """A `datasets.Dataset` of a file, datasets folder or hub dataset id (of config `config`,
    data.dataset_config); ConfigError naming `key` on failure (missing, unreadable, empty)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        table = _load_folder(path, key, split)
    elif path.is_file():
        table = _load_file(path, key)
    elif hub.looks_like_repo_id(spec) and path.suffix.lower() not in _BUILDERS:
        table = _load_hub(spec, key, split, config)
    elif not path.is_absolute():
        where = os.getcwd()  # not the config's folder: name the one it was read from
        raise ConfigError(f"{key}: {spec!r} does not exist in the working folder {where!r}")
    else:
        raise ConfigError(f"{key}: {spec!r} does not exist")
    if len(table) == 0:
        raise ConfigError(f"{key}: {spec!r} holds no records")
    return table


def read_records(path_str: str, key: str, split: str = "train") -> list[dict]:
    """All records of a data source as dicts (small files and tests; training uses `Rows`)."""
    return load_table(path_str, key, split).to_list()


def column_names(table: Table) -> list[str]:
    """Column names of a Dataset, or the union of keys of a list of dicts (in first-seen order)."""
    if hasattr(table, "column_names"):
        return list(table.column_names)
    names: dict[str, None] = {}
    for record in table:
        names.update(dict.fromkeys(record))
    return list(names)


def first_null(table: Table, column: str) -> Optional[int]:
    """Index of the first record whose `column` is missing or null (None if every one has it).

    Datasets: Arrow null counts (no rows are read into Python); lists: a scan."""
    if hasattr(table, "data"):
        if column not in table.column_names:
            return 0
        import pyarrow.compute as pc

        values = table.data.column(column)
        if values.null_count == 0:
            return None
        return int(pc.index(pc.is_null(values), True).as_py())
    for i, record in enumerate(table):
        if record.get(column) is None:
            return i
    return None


def check_records(table: Table, where: str) -> None:
    """Every record of a Python list is a dict (a datasets.Dataset always is)."""
    if isinstance(table, (list, tuple)):
        for i, record in enumerate(table):
            if not isinstance(record, dict):
                raise ConfigError(f"{where}: record {i} is a {type(record).__name__}, not a dict")
        if not table:
            raise ConfigError(f"{where}: holds no records")


class Rows(Sequence):
    """Examples made on access from records of `table` (optionally a subset `indices`).

    `make(record, index)` turns record `index` of the table into an Example; the table is never
    copied into Python objects as a whole."""

    def __init__(
        self,
        table: Table,
        make: Callable[[dict, int], Example],
        indices: Optional[np.ndarray] = None,
    ):
        self.table = table
        self.make = make
        self.indices = None if indices is None else np.asarray(indices, np.int64)

    def __len__(self) -> int:
        return len(self.table) if self.indices is None else len(self.indices)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = int(i)
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        index = i if self.indices is None else int(self.indices[i])
        return self.make(dict(self.table[index]), index)


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
    """(train, val) index arrays of a seeded split; val holds exactly num_val of the records."""
    if not 0 <= num_val <= num_records:
        raise ValueError(f"split_indices: {num_val} held out of {num_records} records")
    order = _rng(split_seed, 1_000_003).permutation(num_records)
    return np.sort(order[num_val:]), np.sort(order[:num_val])
