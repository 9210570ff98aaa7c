"""Orbax checkpoints of the whole run state: save every N steps, keep the last K, resume.

A checkpoint holds one pytree `state` of arrays (params, optax state, the step, a PRNG key;
sharded or not) and one JSON-able `meta` dict, in DIRECTORY/<step>/ (orbax 0.12
CheckpointManager: items state/, meta/, structure/, plus orbax's commit markers and our
jgrpo_checksums.json). Contract: a restore returns exactly `target`'s tree structure or raises
(:class:`CheckpointMismatch`); a step counts only when complete (:func:`is_complete_step`);
:meth:`Checkpointer.verify` catches flipped, truncated or missing bytes (:func:`write_checksums`)
and :meth:`Checkpointer.restore_latest_intact` resumes from the newest intact step, setting
damaged newer ones aside as hidden `.<step>.damaged-*` folders.
Pods: every process calls save and restore (each writes and reads the shards it owns; the
folder must be on a filesystem every host sees; any mesh restores any other); process 0 alone
writes checksums and sets steps aside. Saving is synchronous unless `async_save`: then save
returns once the arrays are on host and the next save, wait or close finishes the write.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp

from jgrpo import distributed
from jgrpo.config import ConfigError
from jgrpo.files import write_atomic

_ITEMS = ("state", "meta", "structure")
_COMMIT_FILE = "commit_success.txt"  # orbax atomicity_types.COMMIT_SUCCESS_FILE
_STEP_METADATA_FILE = "_CHECKPOINT_METADATA"
_STEP_NAME = re.compile(r"^(0|[1-9][0-9]*)$")
_CHECKSUM_FILE = "jgrpo_checksums.json"
_ASIDE = re.compile(r"^\.(0|[1-9][0-9]*)\.damaged-[0-9a-f]+$")


class CheckpointError(ConfigError):
    """No intact checkpoint to restore (one line naming the folder and why)."""


class CheckpointMismatch(ConfigError):
    """The restore target's tree, shapes or dtypes differ from the saved checkpoint (the model
    or optimizer changed since it was saved); a ValueError, as ConfigError is."""


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _step_files(step_dir: Path) -> list[Path]:
    return sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != _CHECKSUM_FILE)


def write_checksums(step_dir: str | Path) -> None:
    """Record size and SHA-256 of every file of a finalized step folder (atomic write).

    Our own checksum because orbax 0.12 (tensorstore / ocdbt) has no end-to-end content check:
    a flipped byte in an uncompressed chunk restores as a silently wrong weight. A step without
    the file (older jgrpo, or killed between orbax's commit and this write) is accepted
    unverified, since orbax's commit markers say it is complete."""
    step_dir = Path(step_dir)
    files = {
        str(p.relative_to(step_dir)): [p.stat().st_size, _digest(p)] for p in _step_files(step_dir)
    }
    write_atomic(step_dir / _CHECKSUM_FILE, json.dumps({"algorithm": "sha256", "files": files}))


def verify_step(step_dir: str | Path) -> Optional[str]:
    """None if the step folder is complete and matches its checksums, else what is wrong."""
    step_dir = Path(step_dir)
    if not step_dir.exists():
        return "missing"
    if not is_complete_step(step_dir):
        return "incomplete (a commit marker or _CHECKPOINT_METADATA is missing or damaged)"
    file = step_dir / _CHECKSUM_FILE
    if not file.exists():
        return None  # unverified: older jgrpo, or killed right after orbax's commit
    try:
        recorded = json.loads(file.read_text())["files"]
        items = [(name, int(size), str(digest)) for name, (size, digest) in recorded.items()]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{_CHECKSUM_FILE} is damaged"
    for name, size, digest in items:
        path = step_dir / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, {size} were saved"
        if _digest(path) != digest:
            return f"{name} does not match its checksum"
    return None


def _leaf_name(i: int) -> str:
    return f"leaf_{i:05d}"


def _is_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _flatten(tree: Any) -> tuple[list[str], list[Any], Any]:
    """(keystr paths, leaves, treedef). The state is saved as a flat dict of numbered leaves
    because orbax rebuilds containers from what it finds on disk (an optax NamedTuple can come
    back as a list, an nnx.State as a dict): the structure always comes from the caller's
    target, matched leaf by leaf after checking that the paths agree. Typed PRNG keys are
    stored as key_data and re-wrapped with the impl recorded at save time."""
    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    paths = [jax.tree_util.keystr(p) for p, _ in leaves_with_paths]
    return paths, [leaf for _, leaf in leaves_with_paths], treedef


def is_complete_step(path: str | Path) -> bool:
    """True if `path` is a finalized checkpoint step folder written by :class:`Checkpointer`.

    orbax writes <step>.orbax-checkpoint-tmp, then commit_success.txt, then renames it to
    <step>; this does not rely on the rename alone: the name is a bare integer, the step and
    every item hold commit_success.txt and _CHECKPOINT_METADATA records a commit timestamp, so
    a killed save or a half-copied folder never counts."""
    path = Path(path)
    if not (_STEP_NAME.match(path.name) and path.is_dir() and not path.is_symlink()):
        return False
    if not (path / _COMMIT_FILE).is_file():
        return False
    if not all((path / item / _COMMIT_FILE).is_file() for item in _ITEMS):
        return False
    try:
        step_metadata = json.loads((path / _STEP_METADATA_FILE).read_text())
    except (OSError, ValueError):
        return False
    return step_metadata.get("commit_timestamp_nsecs") is not None


def complete_steps(directory: str | Path) -> list[int]:
    """Sorted steps of the complete checkpoints in `directory` (empty if it does not exist)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if is_complete_step(p))


def latest_complete_step(directory: str | Path) -> Optional[int]:
    """The newest complete checkpoint step in `directory`, or None; needs no Checkpointer."""
    steps = complete_steps(directory)
    return steps[-1] if steps else None


def _restore_struct(leaf: Any) -> jax.ShapeDtypeStruct:
    """Abstract array orbax restores into: jax leaves keep their sharding, others go to host."""
    if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
        sharding = leaf.sharding
        if sharding is None:
            sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        if _is_key(leaf):
            data = jax.eval_shape(jax.random.key_data, leaf)
            return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
    value = np.asarray(leaf)
    sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)


def _to_target_type(restored: jax.Array, target_leaf: Any, key_impl: Optional[str]) -> Any:
    if isinstance(target_leaf, (jax.Array, jax.ShapeDtypeStruct)):
        if _is_key(target_leaf):
            key = jax.random.wrap_key_data(restored, impl=key_impl)
            if key.dtype != target_leaf.dtype:
                raise ValueError(
                    f"PRNG key impl {key.dtype} on disk, {target_leaf.dtype} in target"
                )
            return key
        return restored
    value = np.asarray(restored)
    if isinstance(target_leaf, np.ndarray):
        return value
    if isinstance(target_leaf, np.generic):
        return value[()]
    return type(target_leaf)(value.item())  # python int / float / bool


class Checkpointer:
    """Saves and restores (state, meta) under `directory`, keeping the last `keep_last` steps.

    Use as a context manager or call :meth:`close` at exit (it waits for an async save).
    """

    def __init__(
        self,
        directory: str | Path,
        keep_last: int = 3,
        *,
        save_period: int = 0,
        async_save: bool = False,
        read_only: bool = False,
    ):
        """`save_period`: :meth:`should_save` is true every this many steps (0 = never).
        `read_only` (export, eval): nothing in `directory` is created or removed; in particular
        a writer's `<step>.orbax-checkpoint-tmp` folders are left alone (a writer removes those of
        a killed run before this returns)."""
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.directory = Path(directory).absolute()
        self.keep_last = keep_last
        self.save_period = save_period
        options = ocp.CheckpointManagerOptions(
            preservation_policy=ocp.checkpoint_managers.LatestN(n=keep_last),
            enable_async_checkpointing=async_save,
            # Removes <step>.orbax-checkpoint-tmp left by a killed run (waited for below).
            cleanup_tmp_directories=not read_only,
            create=not read_only,
            read_only=read_only,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=_ITEMS)
        # orbax removes those tmp folders on a thread it waits for only before its next save; a
        # process that exits first (a resume that finds no intact step: exit 2) raced it and
        # printed its RuntimeError at shutdown. Waiting here leaves no thread behind.
        self._manager._maybe_await_cleanup_tmp_directory()
        self._async = async_save
        self._pending: list[int] = []  # saved steps whose checksums are not yet written

    @classmethod
    def from_config(cls, directory: str | Path, cfg: Any, **kwargs) -> Checkpointer:
        """From a `CheckpointConfig` (keep_last, save_period)."""
        return cls(directory, cfg.keep_last, save_period=cfg.save_period, **kwargs)

    def should_save(self, step: int) -> bool:
        """True every `save_period` steps (never when it is 0)."""
        return self.save_period > 0 and step % self.save_period == 0

    def save(self, step: int, state: Any, meta: Optional[dict] = None) -> None:
        """Write checkpoint `step`; prunes to the newest `keep_last` complete steps.

        `state`: a pytree of jax arrays (any sharding, typed PRNG keys allowed), numpy arrays
        or python scalars. `meta`: JSON-able dict (tuples come back as lists). Raises
        ValueError if an intact `step` already exists; a damaged one is replaced.
        """
        meta = {} if meta is None else meta
        try:
            meta = json.loads(json.dumps(meta, allow_nan=True))
        except TypeError as e:
            raise TypeError(f"checkpoint meta must be JSON-able: {e}") from None
        paths, leaves, _ = _flatten(state)
        arrays, key_impls = {}, {}
        for i, leaf in enumerate(leaves):
            if _is_key(leaf):
                key_impls[_leaf_name(i)] = str(jax.random.key_impl(leaf))
                leaf = jax.random.key_data(leaf)
            elif not isinstance(leaf, jax.Array):
                leaf = np.asarray(leaf)
            arrays[_leaf_name(i)] = leaf
        structure = {
            "paths": paths,
            "shapes": [list(a.shape) for a in arrays.values()],
            "dtypes": [str(a.dtype) for a in arrays.values()],
            "key_impls": key_impls,
        }
        self._finish_pending()
        step_dir = self.directory / str(step)
        if step_dir.exists() or step in self._manager.all_steps():
            reason = verify_step(step_dir)
            if reason is None:
                raise ValueError(f"checkpoint step {step} already exists in {self.directory}")
            self._set_aside(step)  # a damaged or incomplete step: replaced by this save
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(arrays),
                meta=ocp.args.JsonSave(meta),
                structure=ocp.args.JsonSave(structure),
            ),
            force=True,
        )
        self._pending.append(step)
        if not self._async:
            self._finish_pending()

    def _finish_pending(self) -> None:
        """Wait for orbax, then checksum the steps it finished and drop superseded set-asides."""
        if not self._pending:
            return
        self._manager.wait_until_finished()
        newest = max(self._pending)
        pending, self._pending = self._pending, []
        if not distributed.is_primary():  # process 0 finalizes steps and owns these files
            return
        for step in pending:
            if is_complete_step(self.directory / str(step)):
                write_checksums(self.directory / str(step))
        for p in self.directory.iterdir():
            m = _ASIDE.match(p.name)
            if m and int(m.group(1)) <= newest:
                shutil.rmtree(p, ignore_errors=True)

    def _set_aside(self, step: int) -> None:
        """Rename step folder `step` out of orbax's view (hidden), so it can be written again."""
        src = self.directory / str(step)
        if src.exists() and distributed.is_primary():
            os.rename(src, self.directory / f".{step}.damaged-{uuid.uuid4().hex[:8]}")
        distributed.barrier("checkpoint-set-aside")  # every process sees the rename
        self._manager.reload()

    def verify(self, step: int) -> Optional[str]:
        """None if checkpoint `step` is complete and intact, else a short reason."""
        self._finish_pending()
        return verify_step(self.directory / str(step))

    def restore_latest_intact(self, target: Any) -> Optional[tuple[Any, dict, int]]:
        """`(state, meta, step)` of the newest checkpoint that verifies and restores, or None
        when there is no checkpoint at all.

        Each newer step that is damaged (or an incomplete `<step>` folder newer than the one
        restored) is reported in one warning line and set aside so the run can save that step
        again. Raises :class:`CheckpointError` when checkpoints exist but none is intact, and
        :class:`CheckpointMismatch` when `target` does not fit (that is not damage).
        """
        self._finish_pending()
        named = (
            sorted(int(p.name) for p in self.directory.iterdir() if _STEP_NAME.match(p.name))
            if self.directory.is_dir()
            else []
        )
        damaged: list[tuple[int, str]] = []
        for step in reversed(named):
            reason = verify_step(self.directory / str(step))
            if reason is None:
                try:
                    state, meta = self.restore(step, target)
                except CheckpointMismatch:
                    raise
                except Exception as e:  # orbax / tensorstore on bytes the checksum did not cover
                    reason = f"restore failed ({type(e).__name__}: {str(e).splitlines()[0][:160]})"
                else:
                    if damaged:
                        skipped = "; ".join(f"step {s}: {r}" for s, r in damaged)
                        warnings.warn(
                            f"checkpoint damaged, resuming from step {step} ({skipped})",
                            stacklevel=2,
                        )
                        for s, _ in damaged:
                            self._set_aside(s)
                    return state, meta, step
            damaged.append((step, reason))
        if damaged:
            skipped = "; ".join(f"step {s}: {r}" for s, r in damaged)
            raise CheckpointError(f"no intact checkpoint in {str(self.directory)!r} ({skipped})")
        return None

    def all_steps(self) -> list[int]:
        """Steps of the complete checkpoints on disk (an async save counts once finished)."""
        return complete_steps(self.directory)

    def latest_step(self) -> Optional[int]:
        """The newest complete checkpoint step, or None."""
        return latest_complete_step(self.directory)

    def restore(self, step: Optional[int], target: Any) -> tuple[Any, dict]:
        """Load checkpoint `step` (None = latest) as `(state, meta)`.

        `target` gives the structure and placement: a pytree like the saved state whose leaves
        are jax arrays or `jax.ShapeDtypeStruct` (restored onto their `.sharding`; a struct
        without one lands on the first device), numpy arrays (restored as numpy) or python
        scalars (restored as the same type). The result has exactly `target`'s tree structure;
        a different set of leaf paths, a shape or a dtype raises ValueError (no silent casts).
        """
        self.wait()
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
        if not is_complete_step(self.directory / str(step)):
            raise FileNotFoundError(
                f"checkpoint step {step} in {self.directory} is missing or incomplete; "
                f"complete steps: {self.all_steps()}"
            )
        paths, target_leaves, treedef = _flatten(target)
        header = self._manager.restore(
            step, args=ocp.args.Composite(structure=ocp.args.JsonRestore())
        )
        saved_paths = header.structure["paths"]
        if saved_paths != paths:
            missing = sorted(set(saved_paths) - set(paths))[:5]
            extra = sorted(set(paths) - set(saved_paths))[:5]
            raise CheckpointMismatch(
                f"checkpoint step {step}: target tree differs from the saved one "
                f"(saved {len(saved_paths)} leaves, target {len(paths)}; only saved: {missing}; "
                f"only target: {extra})"
            )
        abstract = {_leaf_name(i): _restore_struct(x) for i, x in enumerate(target_leaves)}
        saved = zip(paths, header.structure["shapes"], header.structure["dtypes"], strict=True)
        for (path, shape, dtype), want in zip(saved, abstract.values(), strict=True):
            # orbax would silently pad/truncate a shape or cast a dtype; a resume must not.
            if tuple(shape) != want.shape or dtype != str(want.dtype):
                raise CheckpointMismatch(
                    f"checkpoint step {step}: leaf {path} is {dtype}{shape} on disk, "
                    f"target wants {want.dtype}{list(want.shape)}"
                )
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
            ),
        )
        key_impls = header.structure["key_impls"]
        leaves = [
            _to_target_type(restored.state[_leaf_name(i)], x, key_impls.get(_leaf_name(i)))
            for i, x in enumerate(target_leaves)
        ]
        return jax.tree_util.tree_unflatten(treedef, leaves), dict(restored.meta or {})

    def wait(self) -> None:
        """Block until an in-flight async save is on disk (no-op when synchronous)."""
        self._manager.wait_until_finished()
        self._finish_pending()

    def close(self) -> None:
        """Wait for pending saves and release orbax's threads."""
        self._finish_pending()
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
