"""Custom reward functions (`module:function`): import checks and contained execution.

Why a child process and not threads: a reward function that hangs in a thread can never be
stopped; it keeps its thread (and, if it spins, a share of the GIL) for the rest of the run and
can block interpreter exit. A child process can be interrupted and, if need be, killed. The cost
is one interpreter start (about a second, paid lazily on the first `score` of a task that has
custom rewards, and again only after a kill) plus one pickled round trip per function per
`score` call; per sample there is only a `setitimer` and a 24-byte progress write.

Inside the child (`python -c`, not multiprocessing: nothing is forked from a JAX/Ray process,
and the parent's `__main__` is never re-imported) each call runs on the main thread under a
SIGALRM interval timer of `reward_timeout_s`, which interrupts pure-Python hangs (sleep, loops)
without losing the process. A hang that ignores signals (C code holding the GIL) is caught by
the parent: the child publishes (function, sample, start time) in a shared memory map, and once a
sample runs past `reward_timeout_s + _KILL_SLACK_S` the parent kills the child, restarts it, and
resubmits the unfinished work.

Timeout rule: the first time a function times out within one `score` call, its remaining samples
in that call are not run and count as timeouts too (likewise a call that kills the child: the
function's remaining samples count as errors). Hangs are almost always systematic (a dead
server, a deadlock), and this caps a `score` call at about `reward_timeout_s` per hanging
function instead of N x timeout; the next call tries the function afresh. Exceptions, non-numeric
and non-finite results are errors and score 0 for that sample only.
"""

from __future__ import annotations

import importlib
import inspect
import math
import mmap
import os
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from jgrpo.config import ConfigError

OK, ERROR, TIMEOUT = 0, 1, 2
"""Per-sample status codes returned by `RewardRunner.run`."""

_KILL_SLACK_S = 1.0
"""Extra seconds past the timeout before the parent kills a child that ignores SIGALRM."""
_STARTUP_TIMEOUT_S = 120.0
"""A child that has not started its first sample after this long is killed."""
_PROGRESS = struct.Struct("<ddd")  # (function index, sample index, start time; 0 = idle)
_NEVER = -2  # function index before a child's first sample; -1 = idle between functions


def import_reward_function(spec: str, key: str) -> Callable[[str, str, dict], Any]:
    """Import `module:function`; ConfigError naming `key` if it cannot be used."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{key}: {spec!r} must look like module:function")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except BaseException as e:  # noqa: BLE001 - any import-time failure is a config error
        if isinstance(e, KeyboardInterrupt):
            raise
        detail = " ".join(f"{type(e).__name__}: {e}".split())
        raise ConfigError(f"{key}: cannot import {spec!r} ({detail})") from None
    if not callable(obj):
        raise ConfigError(f"{key}: {spec!r} is not callable (got {type(obj).__name__})")
    try:
        inspect.signature(obj).bind("prompt", "completion", {})
    except TypeError:
        raise ConfigError(
            f"{key}: {spec!r} must accept (prompt, completion, example) positionally"
        ) from None
    except ValueError:  # builtins without a signature: trust them
        pass
    return obj


# ----------------------------------------------------------------------------- the child

_BOOTSTRAP = (  # stdlib only until sys.path is the parent's
    "import sys\n"
    "from multiprocessing.connection import Connection\n"
    "conn = Connection(int(sys.argv[1]), writable=False)\n"
    "init = conn.recv()\n"
    "sys.path[:] = init['sys_path']\n"
    "from jgrpo.tasks.rewards import serve\n"
    "serve(conn, int(sys.argv[2]), init)\n"
)


class _Timeout(BaseException):
    """Raised by SIGALRM inside a reward call; BaseException so `except Exception` can't eat it."""


def _on_alarm(signum, frame):
    raise _Timeout()


def serve(conn: Connection, write_fd: int, init: dict) -> None:
    """Child main loop: run jobs of (function, start, stop) ranges until the pipe closes."""
    import signal

    try:  # die with the parent even when stuck in C code (Linux only; best effort)
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001
        pass
    out = Connection(write_fd, readable=False)
    progress = mmap.mmap(init["progress_fd"], _PROGRESS.size)
    fns = [import_reward_function(spec, spec) for spec in init["specs"]]
    timeout_s = init["timeout_s"]
    signal.signal(signal.SIGALRM, _on_alarm)
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        ranges, prompts, completions, examples = job
        for f, start, stop in ranges:
            values = np.zeros(stop - start, np.float64)
            status = np.zeros(stop - start, np.int8)
            hung = False
            for i in range(start, stop):
                if hung:
                    status[i - start] = TIMEOUT
                    continue
                _PROGRESS.pack_into(progress, 0, f, i, time.monotonic())
                try:
                    signal.setitimer(signal.ITIMER_REAL, timeout_s)
                    try:
                        value = fns[f](prompts[i], completions[i], examples[i])
                    finally:
                        signal.setitimer(signal.ITIMER_REAL, 0)
                    value = float(value)
                    if not math.isfinite(value):
                        raise ValueError(f"non-finite reward {value}")
                    values[i - start] = value
                except _Timeout:
                    status[i - start] = TIMEOUT
                    hung = True
                except Exception:  # noqa: BLE001 - any failure of user code scores 0
                    status[i - start] = ERROR
            _PROGRESS.pack_into(progress, 0, -1, -1, 0.0)
            out.send((f, start, values, status))


# ----------------------------------------------------------------------------- the parent


class _Child:
    """One running child process and its pipes."""

    def __init__(self, specs: Sequence[str], timeout_s: float):
        self._progress_file = tempfile.TemporaryFile()
        self._progress_file.write(_PROGRESS.pack(_NEVER, _NEVER, 0.0))
        self._progress_file.flush()
        self.progress = mmap.mmap(self._progress_file.fileno(), _PROGRESS.size)
        child_r, parent_w = os.pipe()
        parent_r, child_w = os.pipe()
        progress_fd = self._progress_file.fileno()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _BOOTSTRAP, str(child_r), str(child_w)],
            pass_fds=(child_r, child_w, progress_fd),
            stdin=subprocess.DEVNULL,
        )
        os.close(child_r)
        os.close(child_w)
        self.send_conn = Connection(parent_w, readable=False)
        init = dict(
            sys_path=list(sys.path), specs=list(specs), timeout_s=timeout_s, progress_fd=progress_fd
        )
        self.send_conn.send(init)
        self.recv_conn = Connection(parent_r, writable=False)
        self.started = time.monotonic()
        self._finalizer = weakref.finalize(self, _kill, self.proc)

    def read_progress(self) -> tuple[int, int, float]:
        f, i, t = _PROGRESS.unpack_from(self.progress, 0)
        return int(f), int(i), t

    def close(self) -> None:
        self._finalizer()
        for c in (self.send_conn, self.recv_conn):
            c.close()
        self.progress.close()
        self._progress_file.close()


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


class RewardRunner:
    """Runs `module:function` rewards in a child process with per-sample timeouts.

    `run(prompts, completions, examples)` returns (values float64[F, N], status int8[F, N]) with
    status OK / ERROR / TIMEOUT; values are 0 wherever status is not OK. Picklable: the child is
    not part of the state and starts lazily in whichever process calls `run`.
    """

    def __init__(self, specs: Sequence[str], timeout_s: float):
        self.specs = tuple(specs)
        self.timeout_s = float(timeout_s)
        self._child: _Child | None = None
        self._lock = threading.Lock()

    def __getstate__(self):
        return {"specs": self.specs, "timeout_s": self.timeout_s}

    def __setstate__(self, state):
        self.__init__(state["specs"], state["timeout_s"])

    def close(self) -> None:
        """Stop the child process (a later `run` starts a new one)."""
        if self._child is not None:
            self._child.close()
            self._child = None

    def run(self, prompts, completions, examples) -> tuple[np.ndarray, np.ndarray]:
        n, num_fns = len(prompts), len(self.specs)
        values = np.zeros((num_fns, n), np.float64)
        status = np.zeros((num_fns, n), np.int8)
        if n == 0 or num_fns == 0:
            return values, status
        payload = (list(prompts), list(completions), list(examples))
        todo = [(f, 0, n) for f in range(num_fns)]
        with self._lock:
            while todo:
                todo = self._run_once(todo, payload, values, status)
        return values, status

    def _run_once(self, ranges, payload, values, status) -> list[tuple[int, int, int]]:
        """Send `ranges` to the child; after a kill or crash, return the ranges still to run."""
        if self._child is None or self._child.proc.poll() is not None:
            self.close()
            self._child = _Child(self.specs, self.timeout_s)
        child = self._child
        pending = {(f, start): stop for f, start, stop in ranges}
        failure = ERROR
        try:
            child.send_conn.send((ranges, *payload))
            sent_at = time.monotonic()
            while pending:
                if child.recv_conn.poll(0.05):
                    f, start, vals, stats = child.recv_conn.recv()
                    values[f, start : start + len(vals)] = vals
                    status[f, start : start + len(stats)] = stats
                    del pending[(f, start)]
                    continue
                f, i, started = child.read_progress()
                if child.proc.poll() is not None:
                    break  # the child died (os._exit, segfault, OOM kill) inside sample i
                if started > 0 and time.monotonic() - started > self.timeout_s + _KILL_SLACK_S:
                    failure = TIMEOUT
                    break
                if f == _NEVER and time.monotonic() - sent_at > _STARTUP_TIMEOUT_S:
                    break
            else:
                return []
        except (EOFError, OSError):
            pass
        f, i, _ = child.read_progress()
        self.close()
        if f == _NEVER:  # the child never ran a sample: it cannot start, give up on this call
            for (g, s), e in pending.items():
                status[g, s:e] = ERROR
            return []
        key = next(((g, s) for (g, s), e in pending.items() if g == f and s <= i < e), None)
        if key is None:  # died between functions: rerun everything unfinished
            return [(g, s, e) for (g, s), e in pending.items()]
        stop = pending.pop(key)
        status[f, i] = failure
        rest = [(g, s, e) for (g, s), e in pending.items()]
        if key[1] < i:
            rest.insert(0, (f, key[1], i))  # rerun the samples the dead child had finished
        status[f, i + 1 : stop] = failure  # a hang or a crash skips the function's other samples
        return rest
