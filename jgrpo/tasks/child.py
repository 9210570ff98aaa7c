"""The contained child process that user code runs in: reward functions, tools, environments.

A `Child` is `python -c BOOTSTRAP` (nothing forked) that restores the parent's sys.path, then
runs a serve function named in its init message (`jgrpo.tasks.rewards:serve`,
`jgrpo.tasks.tools:serve`). Parent and child talk over two pipes; the child writes what it is
doing into a shared 24-byte record (`PROGRESS`: (a, b, start time)), so the parent can tell a
hang (a call running past its timeout + KILL_SLACK_S: killed) or a crash (the process exits)
from a slow call without asking it. Inside the child every call runs under a SIGALRM timer that
raises `CallTimeout` (a BaseException: `except Exception` in user code cannot swallow it). User
code is named `module:attr` (imported in the child) or sent as cloudpickled bytes
(`object_payload`); `load_all` loads each under data.reward_import_timeout_s. The child dies
with its parent (PR_SET_PDEATHSIG, Linux) and is killed when the parent drops it.
User code is loud: a failing call becomes a `Failure` (name, where, traceback) that travels
with the batch to the trainer process, where `report_failures` prints each name's first one
once per run (or raises `UserCodeError`, data.reward_errors: raise)."""

from __future__ import annotations

import dataclasses
import importlib
import mmap
import os
import struct
import subprocess
import sys
import tempfile
import time
import traceback
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from jgrpo.config import ConfigError

OK, ERROR, TIMEOUT, NONE = 0, 1, 2, 3
"""Status codes of one user call (NONE: a reward function returned None)."""
KILL_SLACK_S = 1.0
"""Extra seconds past the timeout before the parent kills a child that ignores SIGALRM."""
STARTUP_TIMEOUT_S = 120.0
"""A child that has not begun importing the user code after this long is killed."""
PROGRESS = struct.Struct("<ddd")  # (a, b, start time; 0 = idle): rewards (function, sample)
NEVER = -2  # `a` before a child's first import; -1 = idle
IMPORTING = -3  # `b` while object `a` is being imported

BOOTSTRAP = (  # stdlib only until sys.path is the parent's
    "import sys, signal, importlib\n"
    "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
    "from multiprocessing.connection import Connection\n"
    "conn = Connection(int(sys.argv[1]), writable=False)\n"
    "init = conn.recv()\n"
    "sys.path[:] = init['sys_path']\n"
    "try:\n"
    "    module, _, name = init['serve'].partition(':')\n"
    "    serve = getattr(importlib.import_module(module), name)\n"
    "    serve(conn, int(sys.argv[2]), init)\n"
    "except BaseException as e:\n"
    "    sys.stderr.write(f'jgrpo child process stopped: {type(e).__name__}: {e}\\n')\n"
    "    sys.exit(1)\n"
)


class LoadError(Exception):
    """User code cannot be used; the message names it and says why."""


class CallTimeout(BaseException):
    """Raised by SIGALRM inside a user call; BaseException so `except Exception` can't eat it."""


class UserCodeError(RuntimeError):
    """data.reward_errors: raise: a reward function failed; the message holds its name, the
    sample and the traceback (the CLI prints it and exits 1)."""


@dataclasses.dataclass(frozen=True)
class Failure:
    """The first failure of one piece of user code in one batch (picklable: it travels from a
    Ray worker to the trainer with the batch)."""

    name: str
    """How messages name the code: `data.reward_functions[0] ('format_ok')`."""
    where: str
    """Which call: `sample 3`, `samples 0-15 (one batched call)`, `a tool call (row 5)`."""
    text: str
    """The traceback (or what was wrong with the returned value)."""
    counter: str = ""
    """The metric that counts its failures: `reward/format_ok/num_errors`."""
    fatal: bool = False
    """Stop the run (data.reward_errors: raise) instead of reporting once and counting."""


_OURS = {str(Path(__file__).with_name(n)) for n in ("child.py", "rewards.py", "tools.py")}
"""The files whose frames sit above a user call in the child."""


def raised_in_user_code(e: BaseException) -> bool:
    """`e` came from inside the user's code, not from calling it (e.g. a tool called with
    arguments it does not take: the model's mistake, told to the model, not a bug to show)."""
    return any(f.filename not in _OURS for f in traceback.extract_tb(e.__traceback__))


def format_traceback(e: BaseException) -> str:
    """The traceback of `e` caught in the child, without the child's own frames (those above
    the user call): what the user needs to find the bug."""
    frames = traceback.extract_tb(e.__traceback__)
    keep = next((i for i, f in enumerate(frames) if f.filename not in _OURS), None)
    if keep is None:  # raised by our checks of what the code returned: the message says it
        return "".join(traceback.format_exception_only(type(e), e)).rstrip()
    tb = e.__traceback__
    for _ in range(keep):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(e), e, tb)).rstrip()


_REPORTED: set[str] = set()
"""Names whose first failure this process has printed (once per run: one trainer process)."""


def forget_reports() -> None:
    """A new run shows each named code's first failure again (`train.run` calls it)."""
    _REPORTED.clear()


def report_failures(failures) -> None:
    """In the trainer process: print each named code's first failure to stderr, once per run
    (later ones are only counted); raise UserCodeError for a fatal one."""
    for f in failures:
        if f.fatal:
            raise UserCodeError(
                f"{f.name} failed at {f.where} (data.reward_errors: raise):\n{f.text}"
            )
    for f in failures:
        if f.name in _REPORTED:
            continue
        _REPORTED.add(f.name)
        sys.stderr.write(
            f"jgrpo: warning: {f.name} failed at {f.where} (shown once; every failure is "
            f"counted in {f.counter}):\n{f.text}\n"
        )
        sys.stderr.flush()


def on_alarm(signum, frame):
    raise CallTimeout()


def describe(obj: str | Callable) -> str:
    """How messages name user code: the spec string, or the object's name."""
    if isinstance(obj, str):
        return repr(obj)
    return f"function {getattr(obj, '__qualname__', repr(obj))!r}"


def import_object(spec: str) -> Any:
    """The object `module:attr.attr` names; LoadError saying why not."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise LoadError(f"{spec!r} must look like module:function")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except CallTimeout:
        raise
    except BaseException as e:  # noqa: BLE001 - any import-time failure is a config error
        detail = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        if isinstance(e, ModuleNotFoundError) and f"{module_name}.".startswith(f"{e.name}."):
            detail += f"; looked in {', '.join(search_folders())} and the installed packages"
        raise LoadError(f"cannot import {spec!r} ({detail})") from None
    return obj


def search_folders() -> list[str]:
    """The folders on sys.path that can hold user modules (the Python installation's own,
    the standard library and site-packages, left out), as an import error lists them."""
    inside = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    folders: list[str] = []
    for entry in sys.path:
        full = os.path.realpath(entry or os.getcwd())
        if any(full == p or full.startswith(p + os.sep) for p in inside):
            continue
        if full not in folders and os.path.isdir(full):
            folders.append(full)
    return folders


def add_user_folders(config_path: str | os.PathLike | None = None) -> None:
    """The CLI's start: `module:function` may name a module in the working folder or next to
    the config file, as `python script.py` finds one next to its script. Both folders go at the
    end of sys.path (the trainer and its child processes: they never shadow an installed
    package) and of PYTHONPATH (what Ray workers get, `ray_backend._driver_paths`)."""
    folders = [os.getcwd()]
    if config_path is not None:
        folders.append(str(Path(config_path).resolve().parent))
    for folder in folders:
        if folder not in sys.path:
            sys.path.append(folder)
    known = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(known + folders))


def object_payload(obj: str | Callable, key: str, what: str) -> tuple[str, Any]:
    """What the child (`what`: "the reward process") needs to load `obj`: ("import", spec) or
    ("pickle", bytes); ConfigError naming `key` when it cannot be pickled."""
    if isinstance(obj, str):
        return ("import", obj)
    import cloudpickle

    try:
        return ("pickle", cloudpickle.dumps(obj))
    except Exception as e:  # noqa: BLE001
        detail = " ".join(f"{type(e).__name__}: {e}".split())[:200]
        raise ConfigError(f"{key}: cannot send {describe(obj)} to {what} ({detail})") from None


def load_all(payloads, progress, import_timeout_s: float, check: Callable[[Any, str, Any], None]):
    """In the child: (objects, errors [(index, message)]) of `payloads` [(how, data, extra)],
    each loaded under a timer and then checked with `check(obj, name, extra)` (LoadError)."""
    import signal

    objects, errors = [], []
    for f, (how, payload, extra) in enumerate(payloads):
        PROGRESS.pack_into(progress, 0, f, IMPORTING, time.monotonic())
        name = repr(payload) if how == "import" else "the pickled function"
        obj = None
        try:
            signal.setitimer(signal.ITIMER_REAL, import_timeout_s)
            try:
                if how == "import":
                    obj = import_object(payload)
                else:
                    import cloudpickle

                    obj = cloudpickle.loads(payload)
                    name = describe(obj)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            check(obj, name, extra)
        except CallTimeout:
            errors.append((f, f"loading {name} did not finish within {import_timeout_s:g} s"))
            break  # a hung import may have left the interpreter in any state
        except LoadError as e:
            errors.append((f, str(e)))
        except BaseException as e:  # noqa: BLE001 - unpickling runs user code too
            detail = " ".join(f"{type(e).__name__}: {e}".split())[:300]
            errors.append((f, f"cannot load {name} ({detail})"))
        objects.append(obj)
    PROGRESS.pack_into(progress, 0, -1, -1, 0.0)
    return objects, errors


def attach(write_fd: int, init: dict) -> tuple[Connection, mmap.mmap]:
    """In the child, first thing: die with the parent, install the SIGALRM handler; returns
    (the pipe to the parent, the progress record)."""
    import signal

    try:  # die with the parent even when stuck in C code (Linux only; best effort)
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001
        pass
    signal.signal(signal.SIGALRM, on_alarm)
    return Connection(write_fd, readable=False), mmap.mmap(init["progress_fd"], PROGRESS.size)


class Child:
    """One running child process and its pipes (see the module docstring)."""

    def __init__(self, serve: str, init: dict, import_timeout_s: float, what: str):
        self.what = what  # how messages name it: "the reward process"
        self._progress_file = tempfile.TemporaryFile()
        self._progress_file.write(PROGRESS.pack(NEVER, NEVER, 0.0))
        self._progress_file.flush()
        self.progress = mmap.mmap(self._progress_file.fileno(), PROGRESS.size)
        child_r, parent_w = os.pipe()
        parent_r, child_w = os.pipe()
        progress_fd = self._progress_file.fileno()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", BOOTSTRAP, str(child_r), str(child_w)],
            pass_fds=(child_r, child_w, progress_fd),
            stdin=subprocess.DEVNULL,
        )
        os.close(child_r)
        os.close(child_w)
        self._finalizer = weakref.finalize(self, _kill, self.proc, self._progress_file)
        self.send_conn = Connection(parent_w, readable=False)
        self.recv_conn = Connection(parent_r, writable=False)
        self.import_timeout_s = import_timeout_s
        self.started = time.monotonic()
        self.send_conn.send(
            dict(
                init,
                sys_path=list(sys.path),
                serve=serve,
                import_timeout_s=import_timeout_s,
                progress_fd=progress_fd,
            )
        )

    def read_progress(self) -> tuple[int, int, float]:
        a, b, t = PROGRESS.unpack_from(self.progress, 0)
        return int(a), int(b), t

    def wait_ready(self) -> tuple:
        """Wait for the start-up report, the child's first message ("ready", errors, ...):
        errors [(index, problem)] is empty when everything loaded.

        Raises StartFailure(index or None, message) when the child dies or hangs first."""
        while True:
            try:
                if self.recv_conn.poll(0.02):
                    return tuple(self.recv_conn.recv())
            except (EOFError, OSError):  # the child exited: wait for its code below
                try:
                    self.proc.wait(timeout=5.0)
                except subprocess.TimeoutExpired:
                    pass
            f, i, started = self.read_progress()
            code = self.proc.poll()
            if code is not None:
                if i == IMPORTING:
                    raise StartFailure(f, f"ended {self.what} (exit code {code})")
                raise StartFailure(None, f"{self.what} exited (code {code}) at start-up")
            now = time.monotonic()
            if i == IMPORTING and now - started > self.import_timeout_s + KILL_SLACK_S:
                raise StartFailure(f, f"did not finish within {self.import_timeout_s:g} s")
            if f == NEVER and now - self.started > STARTUP_TIMEOUT_S:
                raise StartFailure(None, f"{self.what} did not start")

    def close(self) -> None:
        self._finalizer()
        for c in (self.send_conn, self.recv_conn):
            c.close()
        self.progress.close()
        self._progress_file.close()


class StartFailure(Exception):
    def __init__(self, index, message):
        super().__init__(message)
        self.index = index


def _kill(proc: subprocess.Popen, progress_file) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    progress_file.close()
