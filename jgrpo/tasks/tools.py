"""Tools and environments in contained child processes (jgrpo.tasks.child), rows in parallel.

Tools are typed Python functions with docstrings (`data.tools: ["module:fn"]`, or functions from
Python). Every child imports them; the first reports their JSON schemas (transformers'
`get_json_schema`: what a chat template's `tools=` takes). A call's result becomes the tool
message's text: a string as is; None, numbers, booleans, lists and dicts as JSON; anything else,
an exception, an unknown name or a timeout (data.tool_timeout_s) becomes an `error: ...` text
and is counted. Environments (`data.environment: "module:Class"`, or a class): one per rollout
row, `reset(**record) -> str | None`, `step(text) -> (observation | None, reward | None, done)`;
a reset or step that raises, times out or returns anything else ends the row, counted. A failure
inside user code (not a bad call) keeps its traceback for the trainer (`take_failures`).
`ToolRunner.run(ops)`: ops ("call", row, (name, arguments)), ("reset", row, record), ("step",
row, text), ("clear", -1, None); row r's run in order in child r mod data.tool_processes. A
child that hangs past the timeout + KILL_SLACK_S or crashes is killed and restarted: its running
op fails, queued calls and resets rerun, its environments are lost (their steps fail)."""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any, Optional

from jgrpo.config import ConfigError
from jgrpo.tasks.child import (
    ERROR,
    KILL_SLACK_S,
    OK,
    PROGRESS,
    TIMEOUT,
    CallTimeout,
    Child,
    Failure,
    LoadError,
    StartFailure,
    attach,
    format_traceback,
    load_all,
    object_payload,
    raised_in_user_code,
)

_WHAT = "the tool process"
_SERVE = "jgrpo.tasks.tools:serve"


# ----------------------------------------------------------------------------- the child


def _check_tool(fn: Any, name: str, _) -> None:
    if not callable(fn) or not hasattr(fn, "__name__"):
        raise LoadError(f"{name} is not a function (got {type(fn).__name__})")


def _check_environment(cls: Any, name: str, _) -> None:
    if not callable(cls) or not all(hasattr(cls, m) for m in ("reset", "step")):
        raise LoadError(f"{name} must be a class with reset(**record) and step(text) methods")


def _schema(fn: Callable) -> dict:
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # noqa: BLE001 - transformers' docstring/type-hint errors
        detail = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        raise LoadError(
            f"{fn.__name__!r} needs type hints and a Google-style docstring with an Args "
            f"section for its JSON schema ({detail})"
        ) from None


def _as_text(value: Any, name: str) -> tuple[int, str]:
    if isinstance(value, str):
        return OK, value
    try:
        return OK, json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):
        return ERROR, f"error: {name} returned a {type(value).__name__}, not text or JSON"


def _error(e: BaseException) -> str:
    return "error: " + " ".join(f"{type(e).__name__}: {e}".split())[:300]


def _step_result(value: Any) -> tuple[Optional[str], Optional[float], bool]:
    """A checked step return (ValueError naming what is wrong)."""
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        raise ValueError("step must return (observation | None, reward | None, done)")
    observation, reward, done = value
    if observation is not None and not isinstance(observation, str):
        raise ValueError(f"step's observation is a {type(observation).__name__}, not text")
    if reward is not None:
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise ValueError(f"step's reward is a {type(reward).__name__}, not a number")
        if not math.isfinite(reward):
            raise ValueError(f"step's reward {reward} is not finite")
        reward = float(reward)
    if not isinstance(done, bool):
        raise ValueError(f"step's done is a {type(done).__name__}, not a bool")
    return observation, reward, done


def _run_op(kind: str, row: int, arg: Any, tools: dict, env_cls, envs: dict) -> tuple[int, Any]:
    if kind == "clear":
        envs.clear()
        return OK, None
    if kind == "call":
        name, arguments = arg
        if name not in tools:
            return ERROR, f"error: unknown tool {name!r}; available: {', '.join(tools)}"
        return _as_text(tools[name](**arguments), name)
    if kind == "reset":
        envs.pop(row, None)
        env = env_cls()
        observation = env.reset(**arg)
        if observation is not None and not isinstance(observation, str):
            raise ValueError(f"reset returned a {type(observation).__name__}, not text or None")
        envs[row] = env
        return OK, observation
    if row not in envs:
        return ERROR, "error: this row's environment was lost (its process was restarted)"
    return OK, _step_result(envs[row].step(arg))


def serve(conn: Connection, write_fd: int, init: dict) -> None:
    """Child main loop: load the tools and the environment class, report their schemas, then
    run op lists until the pipe closes."""
    import signal

    out, progress = attach(write_fd, init)
    timeout = init["import_timeout_s"]
    tools, errors = load_all(init["tools"], progress, timeout, _check_tool)
    env_cls = None
    if init["environment"] is not None and not errors:
        loaded, env_errors = load_all([init["environment"]], progress, timeout, _check_environment)
        env_cls = loaded[0]
        errors += [(len(tools), message) for _, message in env_errors]
    schemas = []
    if init["schemas"] and not errors:
        for f, fn in enumerate(tools):
            try:
                schemas.append(_schema(fn))
            except LoadError as e:
                errors.append((f, str(e)))
    out.send(("ready", errors, schemas))
    by_name = {fn.__name__: fn for fn in tools if fn is not None}
    envs: dict[int, Any] = {}
    timeout_s = init["timeout_s"]
    while True:
        try:
            ops = conn.recv()
        except EOFError:
            return
        for op, kind, row, arg in ops:
            PROGRESS.pack_into(progress, 0, op, row, time.monotonic())
            trace = None  # a failure of the user's code: its traceback (or what was wrong)
            try:
                signal.setitimer(signal.ITIMER_REAL, timeout_s)
                try:
                    status, value = _run_op(kind, row, arg, by_name, env_cls, envs)
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                if status == ERROR and kind == "call" and arg[0] in by_name:
                    trace = value.removeprefix("error: ")  # it returned what is not text
            except CallTimeout:
                envs.pop(row, None)  # an environment interrupted mid-step is not trusted again
                status, value = TIMEOUT, f"error: the call did not finish within {timeout_s:g} s"
            except BaseException as e:  # noqa: BLE001 - any failure of user code is counted
                if kind != "call":
                    envs.pop(row, None)
                status, value = ERROR, _error(e)
                if kind != "call" or raised_in_user_code(e):
                    trace = format_traceback(e)
            out.send((op, status, value, trace))
            PROGRESS.pack_into(progress, 0, -1, -1, 0.0)


# ----------------------------------------------------------------------------- the parent


class ToolRunner:
    """Runs tool calls and environment steps in `num_processes` children (module docstring).

    `tools` are `module:function` strings or functions, `keys` the config key naming each (in
    errors); `environment` a `module:Class` string, a class or None."""

    def __init__(
        self,
        tools: Sequence[str | Callable],
        keys: Sequence[str],
        environment: str | type | None,
        timeout_s: float,
        import_timeout_s: float,
        num_processes: int = 1,
    ):
        self.tools, self.keys = tuple(tools), tuple(keys)
        self.environment = environment
        self.timeout_s = float(timeout_s)
        self.import_timeout_s = float(import_timeout_s)
        self.num_processes = max(1, int(num_processes))
        self._init = dict(
            tools=[(*object_payload(t, k, _WHAT), None) for t, k in zip(self.tools, self.keys)],
            environment=None
            if environment is None
            else (*object_payload(environment, "data.environment", _WHAT), None),
            timeout_s=self.timeout_s,
        )
        self._children: list[Optional[Child]] = [None] * self.num_processes
        self._schemas: Optional[list[dict]] = None
        self._lock = threading.Lock()
        self._failures: dict[str, Failure] = {}  # each name's first since take_failures

    def __getstate__(self):
        return dict(
            tools=self.tools,
            keys=self.keys,
            environment=self.environment,
            timeout_s=self.timeout_s,
            import_timeout_s=self.import_timeout_s,
            num_processes=self.num_processes,
        )

    def __setstate__(self, state):
        self.__init__(**state)

    @property
    def active(self) -> bool:
        """There are tools or an environment to run."""
        return bool(self.tools) or self.environment is not None

    @property
    def schemas(self) -> list[dict]:
        """The tools' JSON schemas, in order (starts the children on first use)."""
        if self._schemas is None:
            self.start()
        return list(self._schemas or [])

    def start(self) -> None:
        """The start-up check: every child loads the tools and the environment class (the
        first also makes the schemas); ConfigError naming the first that fails."""
        if not self.active:
            self._schemas = []
            return
        with self._lock:
            self.close()
            for k in range(self.num_processes):
                self._children[k] = self._start_child(k, check=True)

    def _start_child(self, k: int, check: bool) -> Child:
        child = Child(_SERVE, dict(self._init, schemas=k == 0), self.import_timeout_s, _WHAT)
        try:
            _, errors, schemas = child.wait_ready()
        except StartFailure as e:
            child.close()
            if not check:
                raise RuntimeError(f"{_WHAT} failed to restart: {e}") from None
            raise ConfigError(f"{self._key(e.index)}: loading {e}") from None
        if errors:
            child.close()
            raise ConfigError(f"{self._key(errors[0][0])}: {errors[0][1]}")
        if k == 0:
            self._schemas = schemas
        return child

    def take_failures(self) -> list[Failure]:
        """Each tool's and the environment's first failure (raised, returned what it may not,
        or crashed its process) since the last call: for `report_failures` in the trainer."""
        failures, self._failures = list(self._failures.values()), {}
        return failures

    def _note_failure(self, kind: str, row: int, arg: Any, text: str) -> None:
        if kind == "call":
            names = [s.get("function", {}).get("name") for s in self._schemas or []]
            tool = arg[0]
            key = self.keys[names.index(tool)] if tool in names else "data.tools"
            name, where = f"{key} ({tool!r})", f"a call (row {row})"
            counter = f"tools/{tool}/num_errors"
        else:
            env = self.environment
            label = env.rpartition(":")[2] if isinstance(env, str) else env.__name__
            name, where = f"data.environment ({label!r})", f"{kind} (row {row})"
            counter = "environment/errors"
        failure = Failure(name, where, text, counter)
        self._failures.setdefault(name, failure)

    def _key(self, index) -> str:
        if index is None:
            return "data.tools"
        return self.keys[index] if index < len(self.keys) else "data.environment"

    def close(self) -> None:
        """Stop the children (a later `run` starts new ones)."""
        for k, child in enumerate(self._children):
            if child is not None:
                child.close()
                self._children[k] = None

    def run(self, ops: Sequence[tuple[str, int, Any]]) -> list[tuple[int, Any]]:
        """[(status OK / ERROR / TIMEOUT, value)] of each op, in order (module docstring): a
        call's value is its text, a reset's its observation, a step's (observation, reward,
        done); an error's is an `error: ...` text."""
        results: list[Any] = [None] * len(ops)
        queues: dict[int, list] = {}
        for i, (kind, row, arg) in enumerate(ops):
            targets = range(self.num_processes) if kind == "clear" else [row % self.num_processes]
            for k in targets:
                queues.setdefault(k, []).append((i, kind, row, arg))
        with self._lock:
            for k, queue in queues.items():
                self._send(k, queue)
            while queues:
                self._receive(queues, results)
        return results

    def _send(self, k: int, queue: list) -> None:
        if self._children[k] is None or self._children[k].proc.poll() is not None:
            if self._children[k] is not None:
                self._children[k].close()
            self._children[k] = self._start_child(k, check=self._schemas is None)
        self._children[k].send_conn.send(queue)

    def _receive(self, queues: dict[int, list], results: list) -> None:
        """Wait a little for results; kill and restart children that hang or died."""
        conns = {self._children[k].recv_conn: k for k in queues}
        for conn in wait(list(conns), timeout=0.05):
            k = conns[conn]
            try:
                while conn.poll():
                    op, status, value, trace = conn.recv()
                    results[op] = (status, value)
                    if trace is not None:
                        _, kind, row, arg = next(x for x in queues[k] if x[0] == op)
                        self._note_failure(kind, row, arg, trace)
                    queues[k] = [x for x in queues[k] if x[0] != op]
            except (EOFError, OSError):
                pass  # the child died: found below
            if not queues[k]:
                del queues[k]
        for k in list(queues):
            child = self._children[k]
            op, _, started = child.read_progress()
            hung = started > 0 and time.monotonic() - started > self.timeout_s + KILL_SLACK_S
            if child.proc.poll() is None and not hung:
                continue
            queue = queues.pop(k)
            current = next((x for x in queue if x[0] == op), queue[0])
            results[current[0]] = (
                (TIMEOUT, f"error: the call did not finish within {self.timeout_s:g} s")
                if hung
                else (ERROR, f"error: {_WHAT} crashed (exit code {child.proc.poll()})")
            )
            if not hung and current[1] != "clear":
                text = f"it ended {_WHAT} (exit code {child.proc.poll()})"
                self._note_failure(current[1], current[2], current[3], text)
            child.close()
            self._children[k] = None
            redo = []
            for x in queue:
                if x is current:
                    continue
                if x[1] == "step":  # this child's environments are gone
                    results[x[0]] = (ERROR, "error: the environment was lost with its process")
                else:
                    redo.append(x)
            if redo:
                queues[k] = redo
                self._send(k, redo)
