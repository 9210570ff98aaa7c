"""Hugging Face hub ids -> local snapshot folders: downloaded when online, else the cache.

`fetch(repo_id, repo_type, key)` is `huggingface_hub.snapshot_download` of only the files jgrpo
reads (`MODEL_FILES` / `DATASET_FILES`) into the standard HF cache, with its progress bars; with
env `HF_HUB_OFFLINE=1` (read at call time) it only looks the id up in the cache. A missing,
gated or unreachable repo, or a download cut short, is one ConfigError line naming `key` and the
id. `snapshot(repo_id, repo_type)` is the cache-only lookup (None when not cached). The cache is
`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else huggingface_hub's default, laid out as huggingface_hub
expects: `<cache>/<models|datasets>--org--name/{refs/main, snapshots/<revision>/...}`.
A process fetches each id once (`_FETCHED`): the CLI's pre-flight, the trainer's checks and
the model load share one download.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

from jgrpo.config import ConfigError

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
"""What a hub id looks like (`org/name`); anything else is only ever a local path."""

MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model-*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
"""Files of a model repo that jgrpo reads (weights, config, tokenizer); nothing else is fetched."""

DATASET_FILES = (
    "*.parquet",
    "*.jsonl",
    "*.json",
    "*.csv",
    "*.arrow",
    "README.md",
)
"""Files of a dataset repo that `datasets.load_dataset` / `load_from_disk` read (data + card)."""

_FETCHED: dict[tuple[str, str], Path] = {}


def looks_like_repo_id(spec: str) -> bool:
    return bool(REPO_ID.match(spec)) and not spec.startswith((".", "~"))


def offline() -> bool:
    """`HF_HUB_OFFLINE` is set to a true value (1, true, yes, on) now."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def cache_dir() -> Optional[str]:
    """`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else None (huggingface_hub's default)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]).expanduser() / "hub")
    return None


def _patterns(repo_type: str) -> list[str]:
    return list(MODEL_FILES if repo_type == "model" else DATASET_FILES)


def snapshot(repo_id: str, repo_type: str = "model") -> Optional[Path]:
    """The local snapshot folder of a cached repo, or None when it is not cached (or is
    missing some of the files jgrpo reads)."""
    if not looks_like_repo_id(repo_id):
        return None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = snapshot_download(
            repo_id,
            repo_type=repo_type,
            local_files_only=True,
            cache_dir=cache_dir(),
            allow_patterns=_patterns(repo_type),
        )
    except (LocalEntryNotFoundError, ValueError, OSError):
        return None
    return Path(folder)


def fetch(repo_id: str, repo_type: str, key: str) -> Optional[Path]:
    """The snapshot folder of hub id `repo_id`: downloaded (only the files jgrpo reads) unless
    offline; None when offline and not cached (the caller names its own hint). ConfigError
    `key: ...` naming the id when a download fails."""
    if (repo_id, repo_type) in _FETCHED:
        return _FETCHED[(repo_id, repo_type)]
    if offline():
        return snapshot(repo_id, repo_type)
    import httpx2  # huggingface_hub's HTTP client
    import huggingface_hub
    from huggingface_hub import constants, errors

    endpoint = constants.ENDPOINT
    what = "model" if repo_type == "model" else "dataset"
    where = f"{what} {repo_id!r} from {endpoint}"
    try:
        folder = Path(
            huggingface_hub.snapshot_download(
                repo_id,
                repo_type=repo_type,
                cache_dir=cache_dir(),
                allow_patterns=_patterns(repo_type),
            )
        )
    except errors.GatedRepoError:
        raise ConfigError(
            f"{key}: {what} {repo_id!r} is gated: accept its terms on its hub page, then log in "
            "(`hf auth login` or HF_TOKEN)"
        ) from None
    except errors.RepositoryNotFoundError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        why = (
            "needs a login (`hf auth login` or HF_TOKEN)"
            if status == 401
            else "does not exist (or is private: log in with `hf auth login`)"
        )
        raise ConfigError(
            f"{key}: {repo_id!r} is not a local path, and the {what} repo on {endpoint} {why}"
        ) from None
    except errors.RevisionNotFoundError:
        raise ConfigError(f"{key}: {what} {repo_id!r} has no revision 'main'") from None
    except errors.LocalEntryNotFoundError as e:  # unreachable and not (fully) cached
        cause = e.__cause__ or e
        detail = " ".join(f"{type(cause).__name__}: {cause}".split())[:160]
        raise ConfigError(
            f"{key}: {repo_id!r} is not a local path, and downloading the {what} from "
            f"{endpoint} failed with no copy in the local cache ({detail})"
        ) from None
    except (OSError, ValueError, httpx2.HTTPError) as e:  # HTTP, a cut download, the disk
        detail = " ".join(f"{type(e).__name__}: {e}".split())[:200]
        raise ConfigError(f"{key}: downloading {where} failed ({detail})") from None
    _FETCHED[(repo_id, repo_type)] = folder
    return folder
