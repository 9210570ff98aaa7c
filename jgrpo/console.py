"""What a run says on stderr: the `jgrpo` logger's console lines and how loud they are.

`jgrpo: <message>` lines for what a run does (loading, compiling, resuming, saving); the CLI's
default is INFO, `--verbose` DEBUG (per-step timings, each line with the seconds since the
process started), `--quiet` WARNING. The API (`jgrpo.train.run`) attaches the same handler
when nothing in the process configured logging, and leaves a configured `logging` alone.
The attached logger stops propagating: absl configures the root logger when orbax first logs,
which would print each line twice. Lines go through `tqdm.write` once tqdm is imported, so
they print above a progress bar. Standard library only: the CLI calls this before jax loads.
"""

from __future__ import annotations

import logging
import sys

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


def attach_console(level: int | None = None) -> logging.Logger:
    """Print the `jgrpo` logger's lines on stderr (once per process) at `level`.

    `level` None (the API): INFO unless the logger has a level already; nothing is attached
    when the process configured logging itself (the root logger has handlers), so its own
    handlers get the lines instead."""
    logger = logging.getLogger(LOGGER)
    ours = [h for h in logger.handlers if isinstance(h, _ConsoleHandler)]
    if level is None and not ours and (logger.handlers or logging.getLogger().handlers):
        return logger
    if not ours:
        handler = _ConsoleHandler()
        logger.addHandler(handler)
        logger.propagate = False  # absl's basicConfig (orbax logs through it) would repeat them
        ours = [handler]
    if level is not None or logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO if level is None else level)
    ours[0].setFormatter(_Formatter(timed=logger.level <= logging.DEBUG))
    return logger
