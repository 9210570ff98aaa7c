"""Custom reward functions: the signature, the start-up check and contained execution.

Signature (TRL's), called once per function per scored batch, every argument a list aligned
with the rows, passed as keywords: `fn(prompts, completions, completion_ids, **columns) ->
list[float | None]` (chat prompts get `[{"role": "assistant", "content": text}]` completions;
`completion_ids[b]` holds the stop token unless truncated, as TRL's; one list per column).
`per_sample: true` keeps `fn(prompt, completion, example) -> float`. In both forms None or NaN
= no reward from this function for this sample (counted, not a zero); a sample whose every
term is None gets sample_mask 0. Exceptions, timeouts, infinities and non-numbers score 0 and
are counted; each function's first failure in a batch comes back with its traceback (`run`).
Functions run in a child process (`python -c`, nothing forked; `module:function` or
cloudpickled objects): `RewardRunner.start` imports and checks every function under
data.reward_import_timeout_s before any model loads (failing: a ConfigError naming it); each
call runs under a SIGALRM timer of data.reward_timeout_s; a hang that ignores signals is killed
after `reward_timeout_s + KILL_SLACK_S` (restart, resubmit). docs/rewards.md: the full rules."""

from __future__ import annotations

import inspect
import math
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any, Optional

import numpy as np

from jgrpo.config import ConfigError, RewardFunctionConfig
from jgrpo.tasks.child import (  # noqa: F401 - OK .. NONE: RewardRunner.run's status codes
    ERROR,
    KILL_SLACK_S,
    NONE,
    OK,
    PROGRESS,
    TIMEOUT,
    CallTimeout,
    Child,
    LoadError,
    StartFailure,
    attach,
    describe,
    format_traceback,
    import_object,
    load_all,
    object_payload,
)

_RESERVED = ("prompts", "completions", "completion_ids")
_WHAT = "the reward process"


def _check_signature(fn: Any, name: str, per_sample: bool) -> None:
    if not callable(fn):
        raise LoadError(f"{name} is not callable (got {type(fn).__name__})")
    try:
        sig = inspect.signature(fn)
    except ValueError:  # builtins without a signature: trust them
        return
    try:
        if per_sample:
            sig.bind("prompt", "completion", {})
        else:  # columns are passed by name: only prompts= and completions= are checked here
            params = sig.parameters
            if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
                raise TypeError("no **kwargs")
            sig.bind_partial(prompts=[], completions=[])
    except TypeError:
        want = (
            "(prompt, completion, example) positionally"
            if per_sample
            else "prompts=, completions= and **kwargs (TRL's reward signature)"
        )
        raise LoadError(f"{name} must accept {want}") from None


def import_reward_function(spec: str, key: str, per_sample: bool = False) -> Callable:
    """Import `module:function` in this process and check its signature; ConfigError naming
    `key`. (The trainer does this in the reward child instead, see `RewardRunner.start`.)"""
    try:
        fn = import_object(spec)
        _check_signature(fn, repr(spec), per_sample)
    except LoadError as e:
        raise ConfigError(f"{key}: {e}") from None
    return fn


def _payload(rf: RewardFunctionConfig, key: str) -> tuple:
    """What the child needs to load one function: (how, spec or bytes, per_sample)."""
    return (*object_payload(rf.function, key, _WHAT), rf.per_sample)


# ----------------------------------------------------------------------------- the child


def _batch_result(out: Any, n: int) -> tuple[np.ndarray, np.ndarray, Optional[tuple]]:
    """(values, status, problem) of one batched call's return value (module docstring);
    problem: (sample, what is wrong) of the first value that is not a number or None."""
    values = np.zeros(n, np.float64)
    status = np.full(n, ERROR, np.int8)
    if isinstance(out, np.ndarray):
        out = out.tolist()
    if not isinstance(out, (list, tuple)) or len(out) != n:
        what = f"{len(out)} values" if isinstance(out, (list, tuple)) else type(out).__name__
        return values, status, (None, f"returned {what} for {n} samples (want a list of {n})")
    problem = None
    for j, v in enumerate(out):
        values[j], status[j], wrong = _one_value(v)
        if wrong and problem is None:
            problem = (j, wrong)
    return values, status, problem


def _one_value(v: Any) -> tuple[float, int, Optional[str]]:
    """(value, status, what is wrong) of one returned reward: None and NaN are NONE (no
    reward from this function), a finite number OK, anything else an ERROR."""
    if v is None:
        return 0.0, NONE, None
    try:
        x = float(v)
    except (TypeError, ValueError):
        return 0.0, ERROR, f"returned {v!r:.80}, not a number or None"
    if math.isnan(x):
        return 0.0, NONE, None
    if not math.isfinite(x):
        return 0.0, ERROR, f"returned {x}, not a finite number"
    return x, OK, None


def _columns(records: Sequence[dict], start: int, stop: int) -> dict[str, list]:
    keys: dict[str, None] = {}
    for r in records[start:stop]:
        keys.update(dict.fromkeys(r))
    return {k: [r.get(k) for r in records[start:stop]] for k in keys if k not in _RESERVED}


def serve(conn: Connection, write_fd: int, init: dict) -> None:
    """Child main loop: load the functions, then run jobs of (function, start, stop) ranges
    until the pipe closes."""
    import signal

    out, progress = attach(write_fd, init)
    specs = init["specs"]
    fns, errors = load_all(specs, progress, init["import_timeout_s"], _check_signature)
    out.send(("ready", errors))
    timeout_s = init["timeout_s"]
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        ranges, prompts, completions, records, completion_ids = job
        for f, start, stop in ranges:
            if specs[f][2]:
                values, status, failure = _run_per_sample(
                    fns[f], f, start, stop, prompts, completions, records, progress, timeout_s
                )
            else:
                PROGRESS.pack_into(progress, 0, f, start, time.monotonic())
                kwargs = _columns(records, start, stop)
                if completion_ids is not None:
                    kwargs["completion_ids"] = completion_ids[start:stop]
                values, status = np.zeros(stop - start), np.full(stop - start, ERROR, np.int8)
                failure = None
                try:
                    signal.setitimer(signal.ITIMER_REAL, timeout_s)
                    try:
                        result = fns[f](
                            prompts=prompts[start:stop],
                            completions=completions[start:stop],
                            **kwargs,
                        )
                    finally:
                        signal.setitimer(signal.ITIMER_REAL, 0)
                    values, status, problem = _batch_result(result, stop - start)
                    if problem is not None:
                        j, what = problem
                        rows = (start, stop - 1) if j is None else (start + j, start + j)
                        failure = (*rows, f"the batched call {what}")
                except CallTimeout:
                    status = np.full(stop - start, TIMEOUT, np.int8)
                except BaseException as e:  # noqa: BLE001 - any failure of user code scores 0
                    failure = (start, stop - 1, format_traceback(e))
            out.send((f, start, values, status, failure))
            PROGRESS.pack_into(progress, 0, -1, -1, 0.0)


def _run_per_sample(fn, f, start, stop, prompts, completions, records, progress, timeout_s):
    import signal

    values = np.zeros(stop - start, np.float64)
    status = np.zeros(stop - start, np.int8)
    failure = None
    hung = False
    for i in range(start, stop):
        if hung:
            status[i - start] = TIMEOUT
            continue
        PROGRESS.pack_into(progress, 0, f, i, time.monotonic())
        try:
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
            try:
                value = fn(prompts[i], completions[i], records[i])
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            values[i - start], status[i - start], wrong = _one_value(value)
            if wrong and failure is None:
                failure = (i, i, wrong)
        except CallTimeout:
            status[i - start] = TIMEOUT
            hung = True
        except BaseException as e:  # noqa: BLE001 - any failure of user code scores 0
            status[i - start] = ERROR
            if failure is None:
                failure = (i, i, format_traceback(e))
    return values, status, failure


# ----------------------------------------------------------------------------- the parent


class RewardRunner:
    """Runs reward functions in a child process with timeouts (see the module docstring).

    `run(prompts, completions, records, completion_ids)` returns (values float64[F, N], status
    int8[F, N], failures) with status OK / ERROR / TIMEOUT / NONE, values 0 wherever status is
    not OK, failures {f: (first sample, last sample, traceback or problem)}: function f's
    first failure (a batched call's covers its samples).
    `start()` is the start-up check. Picklable: the child is not part of the state and starts
    lazily in whichever process calls `run`.
    """

    def __init__(
        self,
        functions: Sequence[RewardFunctionConfig],
        timeout_s: float,
        import_timeout_s: float = 60.0,
        indices: Sequence[int] | None = None,
        key: str = "data.reward_functions",
    ):
        self.functions = tuple(functions)
        self.key = key
        """The dotted key messages name the functions under (a validation set's own terms)."""
        self.timeout_s = float(timeout_s)
        self.import_timeout_s = float(import_timeout_s)
        # positions in data.reward_functions (messages name them; reward models take others)
        self.indices = tuple(range(len(self.functions)) if indices is None else indices)
        self._payloads = [_payload(rf, self._key(i)) for i, rf in enumerate(self.functions)]
        self._child: Child | None = None
        self._lock = threading.Lock()

    def __getstate__(self):
        return {
            "functions": self.functions,
            "timeout_s": self.timeout_s,
            "import_timeout_s": self.import_timeout_s,
            "indices": self.indices,
            "key": self.key,
        }

    def __setstate__(self, state):
        self.__init__(
            state["functions"],
            state["timeout_s"],
            state["import_timeout_s"],
            state["indices"],
            state["key"],
        )

    def close(self) -> None:
        """Stop the child process (a later `run` starts a new one)."""
        if self._child is not None:
            self._child.close()
            self._child = None

    def _new_child(self) -> Child:
        init = dict(specs=list(self._payloads), timeout_s=self.timeout_s)
        return Child("jgrpo.tasks.rewards:serve", init, self.import_timeout_s, _WHAT)

    def _key(self, index: int) -> str:
        return f"{self.key}[{self.indices[index]}].function"

    def start(self) -> None:
        """The start-up check: load every function in a fresh child; ConfigError naming the
        first that cannot be imported, unpickled or called with the right signature, or whose
        loading exits, crashes or hangs past data.reward_import_timeout_s. Keeps the child."""
        if not self.functions:
            return
        with self._lock:
            self.close()
            child = self._new_child()
            try:
                errors = child.wait_ready()[1]
            except StartFailure as e:
                child.close()
                if e.index is None:
                    raise ConfigError(f"{self.key}: {e}") from None
                what = describe(self.functions[e.index].function)
                raise ConfigError(f"{self._key(e.index)}: loading {what} {e}") from None
            if errors:
                child.close()
                index, message = errors[0]
                raise ConfigError(f"{self._key(index)}: {message}")
            self._child = child

    def run(
        self, prompts, completions, records, completion_ids=None
    ) -> tuple[np.ndarray, np.ndarray, dict[int, tuple[int, int, str]]]:
        n, num_fns = len(prompts), len(self.functions)
        values = np.zeros((num_fns, n), np.float64)
        status = np.zeros((num_fns, n), np.int8)
        failures: dict[int, tuple[int, int, str]] = {}
        if n == 0 or num_fns == 0:
            return values, status, failures
        ids = None if completion_ids is None else [list(map(int, c)) for c in completion_ids]
        payload = (list(prompts), list(completions), list(records), ids)
        todo = [(f, 0, n) for f in range(num_fns)]
        with self._lock:
            while todo:
                todo = self._run_once(todo, payload, values, status, failures)
        return values, status, failures

    def _run_once(self, ranges, payload, values, status, failures) -> list[tuple[int, int, int]]:
        """Send `ranges` to the child; after a kill or crash, return the ranges still to run.
        `failures[f]` gets function f's first (first sample, last sample, what happened)."""
        if self._child is None or self._child.proc.poll() is not None:
            self.close()
            self._child = self._new_child()
            try:
                failed = self._child.wait_ready()[1]
            except StartFailure as e:
                failed = [(f, str(e)) for f in range(len(self.functions))]
            if failed:  # cannot load (only where no start-up check ran): these calls fail
                self.close()
                problems = dict(failed)
                for f, start, stop in ranges:
                    status[f, start:stop] = ERROR
                    failures.setdefault(f, (start, stop - 1, problems.get(f) or failed[0][1]))
                return []
        child = self._child
        pending = {(f, start): stop for f, start, stop in ranges}
        failure = ERROR
        try:
            child.send_conn.send((ranges, *payload))
            while pending:
                if child.recv_conn.poll(0.05):
                    f, start, vals, stats, problem = child.recv_conn.recv()
                    values[f, start : start + len(vals)] = vals
                    status[f, start : start + len(stats)] = stats
                    if problem is not None:
                        failures.setdefault(f, problem)
                    del pending[(f, start)]
                    continue
                f, i, started = child.read_progress()
                if child.proc.poll() is not None:
                    break  # the child died (os._exit, segfault, OOM kill) inside sample i
                if started > 0 and time.monotonic() - started > self.timeout_s + KILL_SLACK_S:
                    failure = TIMEOUT
                    break
            else:
                return []
        except (EOFError, OSError):
            pass
        f, i, _ = child.read_progress()
        code = None
        if failure == ERROR:  # the pipe may close a moment before the exit code is known
            try:
                code = child.proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                pass
        self.close()
        key = next(((g, s) for (g, s), e in pending.items() if g == f and s <= i < e), None)
        if key is None:  # died between functions: rerun everything unfinished
            return [(g, s, e) for (g, s), e in pending.items()]
        stop = pending.pop(key)
        status[f, i] = failure
        if failure == ERROR:
            rows = (i, i) if self.functions[f].per_sample else (key[1], stop - 1)
            failures.setdefault(f, (*rows, f"it ended {_WHAT} (exit code {code})"))
        rest = [(g, s, e) for (g, s), e in pending.items()]
        if key[1] < i:
            rest.insert(0, (f, key[1], i))  # rerun the samples the dead child had finished
        status[f, i + 1 : stop] = failure  # a hang or a crash skips the function's other samples
        return rest
