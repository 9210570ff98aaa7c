"""Atomic writes of files and folders: a reader (or a kill) sees the old one or the new one.

`write_atomic(path, text)` replaces a file through a fsynced temporary beside it;
`atomic_folder(out)` yields an empty temporary folder beside `out` and renames it into place
on clean exit; `write_json(path, obj)` writes indented, key-sorted JSON (inside a folder being
built). Standard library only: every layer (config checks, models, metrics, checkpoints) may
import this file, and it imports nothing of jgrpo.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text` at once (a temporary beside it, fsynced, then renamed): a
    reader or a kill at any moment sees the old file or the new one, never a torn one."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_folder(out: str | Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty temp folder beside `out`; on clean exit rename it to `out`.

    An exception (or a killed process) leaves `out` untouched, only a hidden `.{name}.*`
    temp folder. Raises FileExistsError if `out` exists (before or after building) and not
    `overwrite`.
    """
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        yield tmp
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        old = None
        if overwrite and out.exists():
            old = out.parent / f".{out.name}.{uuid.uuid4().hex[:8]}.old"
            os.rename(out, old)
        try:
            os.rename(tmp, out)
        except OSError:
            if out.exists():
                raise FileExistsError(f"{out} already exists") from None
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_json(path: Path, obj: Any) -> None:
    """`obj` as JSON (indent 2, sorted keys, final newline) in `path` (not atomic by itself)."""
    Path(path).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
