"""Offline lookups in the local Hugging Face hub cache: model and dataset ids -> folders.

`snapshot(repo_id, repo_type)` is `huggingface_hub.snapshot_download(..., local_files_only=True)`
with the cache read at call time (`$HF_HUB_CACHE`, else huggingface_hub's default), so it never
downloads and a test can point it at a faked cache laid out as huggingface_hub expects:
`<cache>/<models|datasets>--org--name/{refs/main, snapshots/<revision>/...}`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
"""What a hub id looks like (`org/name`); anything else is only ever a local path."""


def looks_like_repo_id(spec: str) -> bool:
    return bool(REPO_ID.match(spec)) and not spec.startswith((".", "~"))


def snapshot(repo_id: str, repo_type: str = "model") -> Optional[Path]:
    """The local snapshot folder of a cached repo, or None when it is not cached."""
    if not looks_like_repo_id(repo_id):
        return None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = snapshot_download(
            repo_id,
            repo_type=repo_type,
            local_files_only=True,
            cache_dir=os.environ.get("HF_HUB_CACHE") or None,
        )
    except (LocalEntryNotFoundError, ValueError, OSError):
        return None
    return Path(folder)
