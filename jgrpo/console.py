"""What a run says on stderr: the `jgrpo` logger's console lines and how loud they are.

`jgrpo: <message>` lines for what a run does (loading, compiling, resuming, saving); the CLI's
default is INFO, `--verbose` DEBUG (per-step timings, each line with the seconds since the
process started), `--quiet` WARNING. The CLI and the API (`jgrpo.train.run`) print them within
`console_lines`, unless the program gave the `jgrpo` logger handlers of its own. Lines go
through `tqdm.write` once tqdm is imported, so they print above a progress bar. Standard
library only: the CLI calls this before jax is imported.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

LOGGER = "jgrpo"
"""The name every jgrpo module logs under."""


class _Formatter(logging.Formatter):
    def __init__(self, timed: bool):
        super().__init__()
        self.timed = timed

    def format(self, record: logging.LogRecord) -> str:
        if self.timed:  # relativeCreated: ms since the logging module loaded
            return f"jgrpo: [{record.relativeCreated / 1000:6.1f} s] {record.getMessage()}"
        return f"jgrpo: {record.getMessage()}"


class _ConsoleHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
            tqdm = sys.modules.get("tqdm")
            if tqdm is not None:
                tqdm.tqdm.write(line, file=sys.stderr)
            else:
                print(line, file=sys.stderr, flush=True)
        except Exception:
            self.handleError(record)


@contextlib.contextmanager
def console_lines(level: int | None = None) -> Iterator[logging.Logger]:
    """Within the block, print the `jgrpo` logger's lines on stderr at `level` (None: INFO
    unless the logger has a level already) and only there: the logger does not propagate to
    the root logger meanwhile (absl configures it when orbax first logs, which would print each
    line twice). Both are restored after the block. Nothing changes when the program gave the
    logger handlers of its own."""
    logger = logging.getLogger(LOGGER)
    ours = [h for h in logger.handlers if isinstance(h, _ConsoleHandler)]
    if logger.handlers and not ours:
        yield logger
        return
    if not ours:
        ours = [_ConsoleHandler()]
        logger.addHandler(ours[0])
    before = logger.level, logger.propagate
    if level is not None or logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO if level is None else level)
    ours[0].setFormatter(_Formatter(timed=logger.level <= logging.DEBUG))
    logger.propagate = False
    try:
        yield logger
    finally:
        logger.setLevel(before[0])
        logger.propagate = before[1]
