"""Agents in a contained child process (jgrpo.tasks.child): `data.agent`, many rollouts at once.

An agent is `async def agent(client, record) -> reward | dict | None` (`data.agent:
"module:function"`, or the function). The child imports it (not a coroutine function: a
ConfigError naming data.agent at start-up), then runs each job's rows concurrently in one
asyncio loop, each with an `openai.AsyncOpenAI` on its rollout's base_url and the run's key.
A row's result goes back when known: a number, None, or {"reward", "completion"} (checked);
an agent that raises or returns anything else fails (counted; its traceback kept for
`take_failures`). The parent's `cancel(row)` (the agent's own time ran out) cancels it: TIMEOUT;
an agent that blocks its loop gets its process killed KILL_SLACK_S later (every unfinished
row of that process times out) and restarted for the next job.
`AgentRunner`: `submit(jobs, api_key)` (non-blocking), `poll()`, `cancel(row)`, `running`."""

from __future__ import annotations

import math
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Optional

from jgrpo.config import ConfigError
from jgrpo.tasks.child import (
    ERROR,
    KILL_SLACK_S,
    OK,
    PROGRESS,
    TIMEOUT,
    Child,
    Failure,
    LoadError,
    StartFailure,
    attach,
    load_all,
    object_payload,
)

_WHAT = "the agent process"
_SERVE = "jgrpo.tasks.agents:serve"


def _check_agent(fn: Any, name: str, _) -> None:
    import inspect

    if not inspect.iscoroutinefunction(fn):
        raise LoadError(f"{name} must be an `async def agent(client, record)` function")


def _agent_traceback(e: BaseException) -> str:
    """The traceback of `e` from the agent's first frame (our and asyncio's frames left out)."""
    ours = {str(Path(__file__))}
    frames = traceback.extract_tb(e.__traceback__)
    keep = next(
        (
            i
            for i, f in enumerate(frames)
            if f.filename not in ours and f"{Path('asyncio')}" not in f.filename
        ),
        None,
    )
    if keep is None:
        return "".join(traceback.format_exception_only(type(e), e)).rstrip()
    tb = e.__traceback__
    for _ in range(keep):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(e), e, tb)).rstrip()


def _result(value: Any) -> dict:
    """A checked agent return -> {"reward": float | None, "completion": str | None, "terms":
    {name: float | None} | None}."""
    terms = None
    if isinstance(value, dict):
        unknown = set(value) - {"reward", "completion", "terms"}
        if unknown:
            raise ValueError(f"the agent's dict may hold reward and completion, not {unknown}")
        reward, completion = value.get("reward"), value.get("completion")
        if value.get("terms") is not None:  # reward components (jgrpo.tasks.verifiers_env)
            terms = {str(k): _result(v)["reward"] for k, v in value["terms"].items()}
    else:
        reward, completion = value, None
    if reward is not None:
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise ValueError(f"the agent's reward is a {type(reward).__name__}, not a number")
        if not math.isfinite(reward):
            raise ValueError(f"the agent's reward {reward} is not finite")
        reward = float(reward)
    if completion is not None and not isinstance(completion, str):
        raise ValueError(f"the agent's completion is a {type(completion).__name__}, not text")
    return {"reward": reward, "completion": completion, "terms": terms}


async def _run_job(agent, jobs, api_key: str, timeout_s: float, conn, out, sent: set):
    """Every row of the job at once; a ("cancel", row) message from the parent (the row's own
    time ran out) cancels that row's agent: it reports TIMEOUT."""
    import asyncio

    import openai

    tasks: dict[int, asyncio.Task] = {}
    cancelled: set[int] = set()

    def on_message():
        try:
            while conn.poll():
                kind, row = conn.recv()
                if kind == "cancel" and row in tasks and not tasks[row].done():
                    cancelled.add(row)
                    tasks[row].cancel()
        except (EOFError, OSError):
            pass

    async def one(row: int, base_url: str, record: dict):
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=None)
        try:
            value = await agent(client, record)
            message = (row, OK, _result(value), None)
        except asyncio.CancelledError:
            if row not in cancelled:
                raise
            message = (row, TIMEOUT, f"the agent ran past {timeout_s:g} s of its own time", None)
        except Exception as e:  # noqa: BLE001 - any failure of the agent is counted
            message = (row, ERROR, f"{type(e).__name__}: {e}"[:300], _agent_traceback(e))
        finally:
            try:
                await client.close()
            except BaseException:  # noqa: BLE001
                pass
        out.send(message)
        sent.add(row)

    loop = asyncio.get_running_loop()
    loop.add_reader(conn.fileno(), on_message)
    try:
        for job in jobs:
            tasks[job[0]] = asyncio.ensure_future(one(*job))
        await asyncio.gather(*tasks.values(), return_exceptions=True)
    finally:
        loop.remove_reader(conn.fileno())


def serve(conn: Connection, write_fd: int, init: dict) -> None:
    """Child main loop: load the agent, report, then run jobs until the pipe closes."""
    import asyncio

    out, progress = attach(write_fd, init)
    import openai  # noqa: F401 - imported before the first job, not inside it

    loaded, errors = load_all([init["agent"]], progress, init["import_timeout_s"], _check_agent)
    out.send(("ready", errors))
    agent = loaded[0]
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message[0] == "cancel":  # for a row that has finished since
            continue
        job_id, jobs, api_key, timeout_s = message
        PROGRESS.pack_into(progress, 0, job_id, len(jobs), time.monotonic())
        sent: set[int] = set()
        asyncio.run(_run_job(agent, jobs, api_key, timeout_s, conn, out, sent))
        out.send(("done", job_id))
        PROGRESS.pack_into(progress, 0, -1, -1, 0.0)


class AgentRunner:
    """Runs `agent` over rollouts in `num_processes` children (module docstring); row r runs
    in child r mod num_processes."""

    def __init__(
        self,
        agent: str | Callable,
        timeout_s: float,
        import_timeout_s: float,
        num_processes: int = 1,
        key: str = "data.agent",
    ):
        self.agent, self.key = agent, key
        self.timeout_s = float(timeout_s)
        self.import_timeout_s = float(import_timeout_s)
        self.num_processes = max(1, int(num_processes))
        self._init = dict(agent=(*object_payload(agent, key, _WHAT), None))
        self._children: list[Optional[Child]] = [None] * self.num_processes
        self._running: dict[int, set[int]] = {}  # child -> its rows not yet reported
        self._jobs = 0
        self._cancelled: dict[int, float] = {}  # row -> when it was cancelled
        self._lock = threading.Lock()
        self._failures: dict[str, Failure] = {}
        self._checked = False

    def __getstate__(self):
        return dict(
            agent=self.agent,
            timeout_s=self.timeout_s,
            import_timeout_s=self.import_timeout_s,
            num_processes=self.num_processes,
            key=self.key,
        )

    def __setstate__(self, state):
        self.__init__(**state)

    @property
    def name(self) -> str:
        a = self.agent
        return a.rpartition(":")[2] if isinstance(a, str) else getattr(a, "__name__", repr(a))

    def start(self) -> None:
        """The start-up check: every child imports the agent (ConfigError naming data.agent)."""
        with self._lock:
            self.close()
            for k in range(self.num_processes):
                self._children[k] = self._start_child(check=True)
            self._checked = True

    def _start_child(self, check: bool) -> Child:
        child = Child(_SERVE, dict(self._init), self.import_timeout_s, _WHAT)
        try:
            _, errors = child.wait_ready()
        except StartFailure as e:
            child.close()
            if not check:
                raise RuntimeError(f"{_WHAT} failed to restart: {e}") from None
            raise ConfigError(f"{self.key}: loading {e}") from None
        if errors:
            child.close()
            raise ConfigError(f"{self.key}: {errors[0][1]}")
        return child

    def close(self) -> None:
        for k, child in enumerate(self._children):
            if child is not None:
                child.close()
                self._children[k] = None
        self._running.clear()

    @property
    def running(self) -> int:
        """Rows whose agents have not reported."""
        return sum(len(rows) for rows in self._running.values())

    def submit(self, jobs: list[tuple[int, str, dict]], api_key: str) -> None:
        """Start agents: jobs [(row, base_url, record)], each row in child row mod processes."""
        by_child: dict[int, list] = {}
        for job in jobs:
            by_child.setdefault(job[0] % self.num_processes, []).append(job)
        for k, part in by_child.items():
            child = self._children[k]
            if child is None or child.proc.poll() is not None:
                if child is not None:
                    child.close()
                child = self._children[k] = self._start_child(check=not self._checked)
                self._checked = True
            self._jobs += 1
            child.send_conn.send((self._jobs, part, api_key, self.timeout_s))
            self._running[k] = {row for row, *_ in part}
        self._cancelled = {}

    def poll(self, timeout: float = 0.0) -> list[tuple[int, int, Any]]:
        """[(row, status OK / ERROR / TIMEOUT, value)] of the agents that finished (value: the
        checked result dict, or an error text); kills and reports children that hang or died."""
        found: list[tuple[int, int, Any]] = []
        conns = {self._children[k].recv_conn: k for k in self._running}
        for conn in wait(list(conns), timeout=timeout) if conns else []:
            k = conns[conn]
            try:
                while conn.poll():
                    message = conn.recv()
                    if message[0] == "done":
                        continue
                    row, status, value, trace = message
                    if row not in self._running.get(k, ()):
                        continue
                    self._running[k].discard(row)
                    found.append((row, status, value))
                    if trace is not None or (status == ERROR and value):
                        self._note(row, trace or value)
            except (EOFError, OSError):
                pass  # died: found below
        now = time.monotonic()
        for k in list(self._running):
            if not self._running[k]:
                del self._running[k]
                continue
            child = self._children[k]
            late = lambda r: now - self._cancelled.get(r, now) > KILL_SLACK_S  # noqa: B023
            stuck = [r for r in self._running[k] if late(r)]
            if child.proc.poll() is None and not stuck:
                continue
            code = child.proc.poll()
            for row in sorted(self._running.pop(k)):
                if stuck:  # a cancelled agent blocks its process's event loop: all its rows end
                    text = f"the agent ran past {self.timeout_s:g} s of its own time (it blocked)"
                    found.append((row, TIMEOUT, text))
                else:
                    found.append((row, ERROR, f"{_WHAT} crashed (exit code {code})"))
                    self._note(row, f"it ended {_WHAT} (exit code {code})")
            child.close()
            self._children[k] = None
        return found

    def cancel(self, row: int) -> None:
        """Stop row's agent (its own time ran out): it reports TIMEOUT; if it does not within
        KILL_SLACK_S (it blocks the event loop), its process is killed."""
        k = row % self.num_processes
        if row in self._cancelled or row not in self._running.get(k, ()):
            return
        self._cancelled[row] = time.monotonic()
        try:
            self._children[k].send_conn.send(("cancel", row))
        except OSError:
            pass  # it died: poll finds it

    def _note(self, row: int, text: str) -> None:
        name = f"{self.key} ({self.name!r})"
        self._failures.setdefault(name, Failure(name, f"rollout row {row}", text, "agents/errors"))

    def take_failures(self) -> list[Failure]:
        failures, self._failures = list(self._failures.values()), {}
        return failures
