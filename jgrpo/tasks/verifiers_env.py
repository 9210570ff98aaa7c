"""`data.environment: "verifiers:<id>"`: a Prime Intellect `verifiers` (v1) taskset as the rollout.

`describe(id, args)` (parent, cached): loads the taskset `<id>` (a package in the venv whose
`__all__` exports a `vf.Taskset`) with `data.environment_args` as its config (`harness`: the
agent's harness config) -> the dataset records ({"prompt", "vf_task": index}) and the reward
component names; a missing package, unknown id or bad args is a one-line ConfigError. The
rollout is `episode`, an agent (jgrpo.tasks.agents) run in the contained child: the env runs
its own episode (harness, interception server, local subprocess runtime) against the rollout's
endpoint, its task's rubric scores the trace; returned as {"reward", "completion", "terms":
{component: weight * score}}. A failed episode raises its errors (counted, shown once), as
does one whose components are not the first task's (the terms are fixed at start-up)."""

from __future__ import annotations

import asyncio
import os
from typing import Any, Optional

from jgrpo.config import ConfigError

PREFIX = "verifiers:"
_KEY_VAR = "JGRPO_ENDPOINT_KEY"
_LOADED: dict[tuple, Any] = {}
_SERVING: dict[int, Any] = {}  # id(event loop) -> _Serving


def env_id(environment: Any) -> Optional[str]:
    """The taskset id of a `verifiers:<id>` data.environment, else None."""
    if isinstance(environment, str) and environment.startswith(PREFIX):
        return environment[len(PREFIX) :]
    return None


def _config(vf, tid: str, args: dict):
    taskset = {k: v for k, v in args.items() if k != "harness"}
    agent = {"runtime": {"type": "subprocess"}}
    if "harness" in args:
        agent["harness"] = args["harness"]
    return vf.resolve_env_config({"taskset": {"id": tid, **taskset}, "agent": agent})


def load(tid: str, args: dict) -> tuple[Any, list]:
    """(the vf Env, its tasks) of taskset `tid`, once per process; ConfigError on bad input."""
    key = (tid, repr(sorted(args.items())))
    if key in _LOADED:
        return _LOADED[key]
    where = f"data.environment: {PREFIX}{tid}"
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        need = "needs the `verifiers` package (pip install verifiers)"
        raise ConfigError(f"{where} {need}: {e}") from None
    try:
        env = vf.load_environment(_config(vf, tid, args))
        if not env.taskset.bounded:
            raise ValueError("an infinite taskset (INFINITE = True) is not supported yet")
        tasks = list(env.taskset)
        for harness in env._harnesses.values():
            if harness.NEEDS_CONTAINER:
                name = type(harness).__name__
                raise ValueError(f"harness {name} needs a container; jgrpo runs `subprocess`")
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - any load failure is the config's
        line = " ".join(str(e).split())[:300]
        raise ConfigError(f"{where} (data.environment_args): {type(e).__name__}: {line}") from None
    if not tasks:
        raise ConfigError(f"{where}: the taskset has no tasks")
    _LOADED[key] = env, tasks
    return env, tasks


def describe(tid: str, args: dict) -> tuple[list[dict], tuple[str, ...]]:
    """(dataset records, reward component names) of the taskset (module docstring)."""
    _, tasks = load(tid, args)
    records = [{"prompt": t.data.prompt_text, "vf_task": i} for i, t in enumerate(tasks)]
    first = tasks[0]
    names = [fn.__name__ for fn in first.hooks("reward")]
    names += [j.reward_name for j in first.plugged_judges()]
    return records, tuple(dict.fromkeys(names))


class _Serving:
    """The env's serving resources (interception server, tools) held by one task of the
    event loop while any of its episodes runs (entered and left in the same task)."""

    def __init__(self, env):
        self.env, self.users = env, 0
        self.up = asyncio.get_running_loop().create_future()
        self.done = asyncio.Event()
        self.task = asyncio.ensure_future(self._hold())

    async def _hold(self):
        try:
            async with self.env.serving():
                self.up.set_result(None)
                await self.done.wait()
        except BaseException as e:
            if not self.up.done():
                self.up.set_exception(e)
            raise


async def episode(tid: str, args: dict, client, record: dict) -> dict:
    """One rollout: the env's episode of task record["vf_task"] against `client`'s endpoint."""
    import verifiers.v1 as vf

    env, tasks = load(tid, args)
    task = tasks[record["vf_task"]]
    os.environ[_KEY_VAR] = client.api_key
    loop = id(asyncio.get_running_loop())
    serving = _SERVING.get(loop)
    if serving is None or serving.done.is_set():
        serving = _SERVING[loop] = _Serving(env)
    serving.users += 1
    try:
        await asyncio.shield(serving.up)
        base_url = str(client.base_url).rstrip("/")
        ctx = vf.ModelContext(
            model="jgrpo-policy",
            client=vf.EvalClientConfig(base_url=base_url, api_key_var=_KEY_VAR),
        )
        result = await env.run_episode(task, ctx)
    finally:
        serving.users -= 1
        if serving.users == 0:
            serving.done.set()
            _SERVING.pop(loop, None)
            await serving.task
    errors = list(result.errors) + [e for t in result.traces for e in t.errors]
    if not result.ok or errors:
        text = "\n".join(f"{e.type}: {e.message}\n{e.traceback or ''}".rstrip() for e in errors)
        raise RuntimeError(f"the verifiers episode failed: {text or 'not ok'}")
    terms: dict[str, Optional[float]] = {}
    for trace in result.traces:
        for name, r in trace.rewards.items():
            if r is not None:
                terms[name] = terms.get(name, 0.0) + r.weight * r.score
    unknown = set(terms) - set(describe(tid, args)[1])
    if unknown:  # the reward terms are fixed at start-up (the first task's rewards)
        raise ValueError(
            f"the episode gave reward components {sorted(unknown)} that the "
            f"taskset's first task does not declare"
        )
    completion = result.traces[-1].last_reply if result.traces else None
    return {"reward": sum(terms.values()), "completion": completion or "", "terms": terms}
