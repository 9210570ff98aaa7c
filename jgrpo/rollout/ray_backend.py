"""The Ray rollout backend: `rollout.num_workers` RolloutWorker actors generate and score batches.

The only module of jgrpo that imports ray. `RayRollout` keeps `LocalRollout`'s protocol
(publish / request / collect / evaluate / close); the trainer sees only numpy `RolloutResult`s.
Weights: `publish` puts ONE object per version (on a pod each process puts only its planned,
de-duplicated shards, `plan_shards` / `local_shards`, registered with the `WeightBroker`; a
worker pulls and `assemble_shards` them); a worker pulls a version at most once and only if it
generates with it; with LoRA the frozen base goes once, then adapters only. Scheduling: no
background thread; each call reaps finished batches and hands queued parts to idle workers.
A step is split into per-worker parts over contiguous prompts, all with `step_key(seed, s)` and
draws keyed by the global row, so joined parts equal the local backend's batch. Sync
(max_staleness 0) or async (step s may start when s - newest version <= k; `collect` re-checks
the bound). Faults: a dead or raising worker is replaced and its batch re-queued with the same
key; failure `max_worker_failures + 1` raises `RolloutFailure`. docs/rollout.md and
docs/pods.md describe weight sync, scheduling, resources and metrics in full."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Optional

import jax
import numpy as np
import ray

from jgrpo import distributed
from jgrpo.config import Config, ConfigError
from jgrpo.rollout.engine import VALIDATION_SALT, RolloutFailure, step_key, train_salt
from jgrpo.rollout.results import RolloutResult, concat_results, gather_pod_rows, join_pod_slice
from jgrpo.rollout.weight_shards import assemble_shards, local_shards
from jgrpo.tasks.child import report_failures


def init_ray(address: Optional[str] = None, num_cpus: Optional[int] = None) -> bool:
    """Start a quiet local Ray (address None) or join `address`; False if already initialised."""
    if ray.is_initialized():
        return False
    if address is not None:
        check_ray_address(address)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray >= 2.5x warns on every new local cluster that token auth is on by default: keep the
    # (secure) default, drop the banner.
    logging.getLogger("ray._private.authentication").setLevel(logging.ERROR)
    start = time.monotonic()
    try:
        ray.init(
            address=address or "local",
            num_cpus=num_cpus if address is None else None,
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.WARNING,
            configure_logging=True,
        )
    except (ConnectionError, RuntimeError, ValueError) as e:
        if address is None:
            raise
        waited = time.monotonic() - start
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"rollout.ray_address: cannot join the Ray cluster at {address!r} "
            f"(gave up after {waited:.1f} s: {first})"
        ) from None
    return True


RAY_CONNECT_TIMEOUT_S = 5.0
"""How long init_ray waits for a TCP connection to rollout.ray_address's host:port."""


def check_ray_address(address: str) -> None:
    """ConfigError within RAY_CONNECT_TIMEOUT_S (ray.init itself would wait much longer) when
    the host:port of `address` does not accept a TCP connection; the pre-flight
    (train.check_run) calls it."""
    import socket

    target = address.removeprefix("ray://")
    host, sep, port = target.rpartition(":")
    if address == "auto" or not sep or not port.isdigit():
        return  # "auto" and bare names: ray resolves them, its own error is clear
    start = time.monotonic()
    try:
        socket.create_connection((host.strip("[]"), int(port)), RAY_CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise ConfigError(
            f"rollout.ray_address: {address!r} is not reachable (waited "
            f"{time.monotonic() - start:.1f} s: {e.strerror or type(e).__name__})"
        ) from None


def _driver_paths() -> dict[str, str]:
    """The driver's PYTHONPATH, for workers of a cluster the driver did not start (they inherit
    the environment of their node's raylet): custom reward modules (`module:function`) import
    there as they do in the trainer, from paths every host sees."""
    path = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": path} if path else {}


def _driver_xla_flags() -> list[str]:
    """The driver's XLA_FLAGS less those a worker sets itself (device count, threads): workers
    compile the sampler as the driver does, so Ray and local rollouts agree bit for bit."""
    own = ("--xla_force_host_platform_device_count", "--xla_cpu_multi_thread_eigen", "intra_op")
    return [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(own)]


def worker_resources(
    num_workers: int,
    cpus: Optional[float] = None,
    gpus: Optional[float] = None,
    num_drivers: int = 1,
) -> tuple[float, float, dict[str, str]]:
    """(num_cpus, num_gpus, env_vars) of one worker, derived from the cluster unless given.

    `num_drivers`: trainer processes sharing the cluster, each with `num_workers` workers."""
    total = ray.cluster_resources()
    num_workers *= num_drivers
    if gpus is None:
        total_gpus = total.get("GPU", 0.0)
        gpus = min(1.0, total_gpus / num_workers) if total_gpus else 0.0
        if gpus >= 1:
            gpus = float(int(total_gpus // num_workers))
    if cpus is None:
        total_cpus = total.get("CPU", 1.0)
        if total_cpus < num_workers:
            cpus = total_cpus / num_workers  # fractional: every worker still gets scheduled
        else:
            # + num_drivers: the trainer processes
            cpus = float(max(1, int(total_cpus // (num_workers + num_drivers))))
    threads = max(1, int(cpus))
    flags = _driver_xla_flags()
    if threads == 1:
        flags.append("--xla_cpu_multi_thread_eigen=false")
    env = _driver_paths() | {
        "XLA_FLAGS": " ".join([*flags, f"intra_op_parallelism_threads={threads}"]),
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": str(threads),
        "PJRT_NPROC": str(threads),  # XLA:CPU's pool: its share, not a driver's (jgrpo/__init__)
    }
    if gpus == 0:
        env["JAX_PLATFORMS"] = "cpu"
    elif gpus < 1:
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # GPU shared between workers
    return cpus, gpus, env


# ----------------------------------------------------------------------------- pod weight sync


class WeightBroker:
    """A Ray actor on a pod: per weight version, the ObjectRef of each trainer process's shards.

    Every process puts its own shards (`local_shards`) in the object store and hands the broker
    the ref (boxed, so Ray passes it by reference and counts the broker as a borrower); `get`
    waits until every process has done so for that key, then returns the refs in process order.
    Each process asks once per key; once all have their answer the broker forgets the key, so
    a version's shards live exactly as long as some driver's answer (its newest version, or one
    a running batch names) refers to them: Ray counts the refs nested in an answer."""

    def __init__(self, num_processes: int):
        import asyncio

        self.num_processes = num_processes
        self.refs: dict[tuple, dict[int, ray.ObjectRef]] = {}
        self.answered: dict[tuple, int] = {}
        self.changed = asyncio.Condition()

    def ready(self) -> bool:
        return True

    def num_keys(self) -> int:
        """Keys not yet answered to every process (a test hook)."""
        return len(self.refs)

    async def put(self, key: tuple, process: int, box: list) -> None:
        async with self.changed:
            self.refs.setdefault(key, {})[process] = box[0]
            self.changed.notify_all()

    async def get(self, key: tuple) -> list:
        async with self.changed:
            await self.changed.wait_for(lambda: len(self.refs.get(key, ())) == self.num_processes)
            refs = [self.refs[key][p] for p in range(self.num_processes)]
            self.answered[key] = self.answered.get(key, 0) + 1
            if self.answered[key] == self.num_processes:
                del self.refs[key], self.answered[key]
            return refs


def pull_weights(box: list):
    """A worker's host copy of published weights: the tree itself (one trainer process), or a
    broker answer, one ref per trainer process, whose shards it assembles (a pod)."""
    value = ray.get(box[0])
    if isinstance(value, list):
        return assemble_shards(ray.get(value))
    return value


BROKER_NAMESPACE = "jgrpo"
"""Ray namespace of the pod's WeightBroker (named actors are looked up within a namespace)."""


class RolloutWorker:
    """A Ray actor: an engine (tokenizer, task, sampler) and a cached copy of one weight version."""

    def __init__(self, cfg: Config, model_folder: str):
        from jgrpo.rollout.engine import build_engine

        self.engine, self.graphdef = build_engine(cfg, model_folder)
        self.version: Optional[int] = None
        self.params = None
        self.frozen = None  # the LoRA base, pulled once

    def pid(self) -> int:
        return os.getpid()

    def rollout(
        self, version: int, params_box: list, job: _Job, seed: int, frozen_box=None
    ) -> RolloutResult:
        pull_s = 0.0
        if frozen_box is not None and self.frozen is None:
            start = time.perf_counter()
            self.frozen = jax.block_until_ready(jax.device_put(pull_weights(frozen_box)))
            pull_s += time.perf_counter() - start
        if version != self.version:
            start = time.perf_counter()
            self.params = None  # free the old copy before the new one lands
            self.params = jax.block_until_ready(jax.device_put(pull_weights(params_box)))
            self.version = version
            pull_s += time.perf_counter() - start
        start = time.perf_counter()
        result = self.engine.rollout(
            self.graphdef,
            self.params if self.frozen is None else self.frozen | self.params,
            job.examples,
            step_key(seed, job.step, job.salt),
            version,
            job.num_generations,
            greedy=job.greedy,
            first_prompt=job.first_prompt,
            training=job.salt != VALIDATION_SALT,
            val_set=job.val_set,
        )
        result.stats["rollout/weight_pull_s"] = pull_s
        result.stats["rollout/generate_s"] = time.perf_counter() - start
        return result


@dataclasses.dataclass
class _Job:
    """One batch to generate: a training step (bounded staleness) or a validation pass."""

    name: tuple  # ("train", step, gen_batch, part) | ("eval", n, 0, part)
    step: int
    examples: list
    salt: int
    num_generations: int
    greedy: bool
    max_staleness: Optional[int]  # None: no bound (validation uses the newest weights)
    first_prompt: int = 0  # index of examples[0] within the whole step
    val_set: Optional[str] = None  # validation of this data.val_sets entry (its task)


class RayRollout:
    """Backend protocol over RolloutWorker actors (see the module docstring)."""

    def __init__(
        self,
        cfg: Config,
        model_folder,
        *,
        frozen=None,
        num_cpus_per_worker: Optional[float] = None,
        num_gpus_per_worker: Optional[float] = None,
        reward_names: Optional[dict] = None,
    ):
        ro = cfg.rollout
        self.pod = distributed.is_multiprocess()
        self.reward_names = dict(reward_names or {None: ()})  # None: the run's; a val set's
        self.cfg = cfg
        self.model_folder = str(model_folder)
        self.seed = cfg.grpo.seed
        self.num_generations = cfg.grpo.num_generations_per_prompt
        self.max_staleness = ro.max_staleness
        self.max_failures = ro.max_worker_failures
        self.failures = 0
        self.owns_ray = init_ray(ro.ray_address)
        cpus, gpus, env = worker_resources(
            ro.num_workers, num_cpus_per_worker, num_gpus_per_worker, distributed.process_count()
        )
        options: dict[str, Any] = {}
        self._broker = None
        if self.pod:  # this process's workers near its shards when resources allow
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            node = ray.get_runtime_context().get_node_id()
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=True)
            self._broker = self._join_broker()
        self._actor_cls = ray.remote(RolloutWorker).options(
            num_cpus=cpus, num_gpus=gpus, runtime_env={"env_vars": env}, max_restarts=0, **options
        )
        self._workers: list[Any] = [None] * ro.num_workers
        self._pids: list[Any] = [None] * ro.num_workers
        for i in range(ro.num_workers):
            self._start_worker(i)
        self._latest: Optional[tuple[int, ray.ObjectRef]] = None
        self._frozen = frozen
        self._frozen_ref: Optional[ray.ObjectRef] = None
        self._queue: list[_Job] = []
        self._running: dict[ray.ObjectRef, tuple[int, _Job, int]] = {}
        self._results: dict[tuple, RolloutResult] = {}
        self._requested: set[tuple] = set()
        self._parts: dict[tuple, list[_Job]] = {}
        self._num_evals = 0
        self._regenerated = 0

    # ------------------------------------------------------------------------- protocol

    def publish(self, params, version: int) -> dict[str, float]:
        """Host-gather `params` once and put one object for the workers to pull (and the
        frozen base, on the first publish only). On a pod: this process's shards only."""
        if self._latest is not None and version <= self._latest[0]:
            raise ValueError(f"publish: version {version} after version {self._latest[0]}")
        if self.pod:
            return self._publish_shards(params, version)
        start = time.perf_counter()
        host = jax.device_get(params)
        frozen_host = None
        if self._frozen is not None and self._frozen_ref is None:
            frozen_host = jax.device_get(self._frozen)
        gathered = time.perf_counter()
        if frozen_host is not None:
            self._frozen_ref = ray.put(frozen_host)
        self._latest = (version, ray.put(host))
        done = time.perf_counter()
        self._pump()
        nbytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves((host, frozen_host)))
        return self._sync_metrics(start, gathered, done, nbytes)

    def _sync_metrics(self, start: float, gathered: float, done: float, nbytes: int) -> dict:
        """A publish's metrics: its gather (device -> host) and put (-> object store) times."""
        return {
            "perf/weight_sync_s": done - start,
            "rollout/weight_gather_s": gathered - start,
            "rollout/weight_put_s": done - gathered,
            "rollout/weight_mb": nbytes / 2**20,
            "rollout/worker_failures": float(self.failures),
        }

    def _publish_shards(self, params, version: int) -> dict[str, float]:
        """A pod's publish: put the shards this process sends (`local_shards`) and register
        them with the broker; the workers assemble every process's shards."""
        me = distributed.process_index()
        start = time.perf_counter()
        part = local_shards(params)
        base = None
        if self._frozen is not None and self._frozen_ref is None:
            base = local_shards(self._frozen)
        gathered = time.perf_counter()
        if base is not None:
            self._broker.put.remote(("base",), me, [ray.put(base)])
            self._frozen_ref = self._broker.get.remote(("base",))
        self._broker.put.remote(("params", version), me, [ray.put(part)])
        self._latest = (version, self._broker.get.remote(("params", version)))
        done = time.perf_counter()
        self._pump()
        leaves = [leaf for p in (part, base) if p is not None for leaf in p["leaves"]]
        nbytes = sum(data.nbytes for _, _, shards in leaves for _, data in shards)
        return self._sync_metrics(start, gathered, done, nbytes)

    def request(self, step: int, examples: list, gen_batch: int = 0) -> None:
        """Queue step's batch (its `gen_batch`-th generation batch: dynamic sampling); it
        starts now if a worker is idle and the weights are fresh. On a pod: this process's
        slice of the examples only."""
        name = ("train", step, gen_batch)
        if name in self._requested:
            raise ValueError(f"request: step {step} was already requested")
        self._requested.add(name)
        lo, hi = distributed.process_slice(len(examples))
        salt = train_salt(gen_batch)
        self._queue += self._split(
            name, step, examples[lo:hi], salt, self.num_generations, False, lo
        )
        self._queue.sort(key=lambda j: (j.name[0] == "train", j.step, *j.name[2:]))
        self._pump()

    def collect(self, step: int, gen_batch: int = 0) -> RolloutResult:
        """Block until step's batch is scored; returns it once (a second collect raises)."""
        name = ("train", step, gen_batch)
        if name not in self._requested:
            raise KeyError(f"collect: step {step} was not requested (or was already collected)")
        result = self._gather(name)
        self._requested.discard(name)
        return result

    def evaluate(
        self, examples: list, step: int, pass_k: int = 1, val_set: Optional[str] = None
    ) -> RolloutResult:
        """Validation generations with the newest weights (greedy when pass_k == 1), blocking;
        `val_set`: a data.val_sets entry's examples, prompted and scored by its task."""
        name = ("eval", self._num_evals, 0)
        self._num_evals += 1
        lo, hi = distributed.process_slice(len(examples))
        jobs = self._split(
            name, step, examples[lo:hi], VALIDATION_SALT, pass_k, pass_k == 1, lo, val_set
        )
        self._queue[:0] = jobs
        return self._gather(name, val_set)

    def close(self) -> None:
        for worker in self._workers:
            if worker is not None:
                ray.kill(worker, no_restart=True)
        self._workers = [None] * len(self._workers)
        self._running.clear()
        self._queue.clear()
        self._latest = None
        self._frozen_ref = None
        if self._broker is not None and distributed.is_primary():
            # every process is past its last pull: the run's last step ended in a collective
            ray.kill(self._broker, no_restart=True)
        self._broker = None
        if self.owns_ray:
            ray.shutdown()
            self.owns_ray = False

    # ------------------------------------------------------------------------- test hooks

    def worker_pids(self) -> list[int]:
        """OS pids of the current workers (waits until each has started)."""
        return ray.get(list(self._pids))

    # ------------------------------------------------------------------------- scheduling

    def _join_broker(self):
        """The pod's WeightBroker: process 0 starts it under a fresh name, every process
        learns the name from a host gather and looks it up."""
        import uuid

        name = f"jgrpo-weights-{uuid.uuid4().hex}"
        if distributed.is_primary():
            broker = (
                ray.remote(WeightBroker)
                .options(
                    name=name,
                    namespace=BROKER_NAMESPACE,
                    num_cpus=0,
                    max_restarts=0,
                    runtime_env={"env_vars": _driver_paths() | {"JAX_PLATFORMS": "cpu"}},
                )
                .remote(distributed.process_count())
            )
            ray.get(broker.ready.remote())
        name = distributed.allgather(name.encode(), raw=True)[0].decode()
        if not distributed.is_primary():
            broker = ray.get_actor(name, namespace=BROKER_NAMESPACE)
        return broker

    def _start_worker(self, i: int) -> None:
        worker = self._actor_cls.remote(self.cfg, self.model_folder)
        self._workers[i] = worker
        self._pids[i] = worker.pid.remote()  # runs right after __init__, before any batch

    def _restart_worker(self, i: int) -> None:
        ray.kill(self._workers[i], no_restart=True)  # it may still be alive after an exception
        self._start_worker(i)

    def _split(
        self, name, step, examples, salt, num_generations, greedy, first=0, val_set=None
    ) -> list[_Job]:
        """One job per worker over contiguous prompt ranges (per-row keys: same draws);
        `first`: the index of examples[0] in the whole step (a pod host's slice)."""
        bounds = np.linspace(0, len(examples), min(len(self._workers), len(examples)) + 1)
        bounds = bounds.astype(int)
        staleness = None if name[0] == "eval" else self.max_staleness
        jobs = [
            _Job(
                (*name, part),
                step,
                list(examples[lo:hi]),
                salt,
                num_generations,
                greedy,
                staleness,
                first_prompt=first + int(lo),
                val_set=val_set,
            )
            for part, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:]))
        ]
        self._parts[name] = jobs
        return jobs

    def _gather(self, name: tuple, val_set: Optional[str] = None) -> RolloutResult:
        """Wait for every part of `name` and join them in row order."""
        jobs = self._parts.pop(name)
        parts = [self._wait_for(job.name) for job in jobs]
        report_failures([f for p in parts for f in p.failures])  # the workers' user code, once
        result = concat_results(parts, [job.first_prompt for job in jobs]) if parts else None
        if self.pod:  # this host's rows, the pod's statistics (collective)
            if name[0] == "train":
                result = join_pod_slice(result)
            else:
                result = gather_pod_rows(result, self.reward_names[val_set])
        staleness = name[1] - result.batch["weight_version"].astype(np.int64)
        if name[0] == "train":
            result.stats["rollout/staleness_max"] = float(staleness.max())
            result.stats["rollout/staleness_mean"] = float(staleness.mean())
        for key in ("rollout/weight_pull_s", "rollout/generate_s"):
            result.stats[key] = max((p.stats[key] for p in parts), default=0.0)
        result.stats["rollout/worker_failures"] = float(self.failures)
        result.stats["rollout/regenerated"] = float(self._regenerated)
        return result

    def _wait_for(self, name: tuple) -> RolloutResult:
        while name not in self._results:
            self._dispatch()
            if not self._running:
                version = None if self._latest is None else self._latest[0]
                raise RuntimeError(
                    f"rollout: {name[0]} step {name[1]} cannot start: no weights fresh enough "
                    f"(newest published version: {version}, "
                    f"rollout.max_staleness: {self.max_staleness}); publish before collect"
                )
            self._reap(block=True)
        self._dispatch()  # keep workers busy with queued steps while the trainer trains
        return self._results.pop(name)

    def _pump(self) -> None:
        self._reap(block=False)
        self._dispatch()

    def _dispatch(self) -> None:
        if self._latest is None:
            return
        version, ref = self._latest
        busy = {w for w, _, _ in self._running.values()}
        for job in list(self._queue):
            if job.max_staleness is not None and job.step - version > job.max_staleness:
                continue  # too far ahead of the newest weights: wait for a newer publish
            n = len(self._workers)
            first = job.step + job.name[3]
            idle = [(first + j) % n for j in range(n) if (first + j) % n not in busy]
            if not idle:
                return
            w = idle[0]
            frozen = None if self._frozen_ref is None else [self._frozen_ref]
            out = self._workers[w].rollout.remote(version, [ref], job, self.seed, frozen)
            self._running[out] = (w, job, version)
            self._queue.remove(job)
            busy.add(w)

    def _reap(self, block: bool) -> None:
        if not self._running:
            return
        refs = list(self._running)
        if block:
            ready, _ = ray.wait(refs, num_returns=1)
        else:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        for out in ready:
            w, job, version = self._running.pop(out)
            try:
                result = ray.get(out)
            except ray.exceptions.RayError as error:
                self._fail(w, job, error)
                continue
            staleness = job.step - result.batch["weight_version"].astype(np.int64)
            if job.max_staleness is not None and staleness.max() > job.max_staleness:
                # unreachable by the dispatch rule; the bound is the contract
                self._regenerated += 1
                self._queue.insert(0, job)
                continue
            self._results[job.name] = result

    def _fail(self, w: int, job: _Job, error: Exception) -> None:
        self.failures += 1
        if self.failures > self.max_failures:
            raise RolloutFailure(
                f"rollout worker failure {self.failures} exceeds rollout.max_worker_failures="
                f"{self.max_failures} ({job.name[0]} step {job.step} on worker {w}): "
                f"{type(error).__name__}: {_last_line(error)}"
            ) from error
        self._restart_worker(w)
        self._queue.insert(0, job)  # re-issued first, same step and key: nothing lost or doubled


def _last_line(error: Exception) -> str:
    """The line of a (remote) traceback that names the error."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else repr(error)
