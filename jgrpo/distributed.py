"""Multi-host pods: which process this is, jax.distributed start-up, host gathers, dead peers.

One `jgrpo train` process runs per host (JAX multi-controller), every one running the same
`train.run(config)` over the global mesh. This file owns the processes themselves (the mesh
over them is sharding.py's, the per-host slice of a step's prompts rollout/local.py's):
:func:`resolve_spec` (CLI flags, else JGRPO_* variables, else a cluster jax detects: SLURM,
Open MPI, JAX_COORDINATOR_ADDRESS; else one process), :func:`initialize` (before anything
touches a device; gloo collectives on CPU, so a pod of CPU processes runs a GPU pod's program),
a watchdog that ends this process with EXIT_LOST_PEER and one line naming the lost peer and the
checkpoint to --resume from (:func:`_watch`), :func:`align_first_runs` (every process starts a
new program together) and :func:`allgather` / :func:`barrier` (small host values through the
coordinator's key-value store, in process order; :class:`PeerLost` when it is gone).
It imports nothing of jgrpo but config: what it needs from checkpoints is passed in
(:func:`watch_checkpoints`).
"""

from __future__ import annotations

import dataclasses
import io
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Optional

import numpy as np

from jgrpo.config import ConfigError

ENV_COORDINATOR = "JGRPO_COORDINATOR"
ENV_NUM_PROCESSES = "JGRPO_NUM_PROCESSES"
ENV_PROCESS_ID = "JGRPO_PROCESS_ID"
ENV_PEER_TIMEOUT = "JGRPO_PEER_TIMEOUT"
DEFAULT_PEER_TIMEOUT_S = 60.0
EXIT_LOST_PEER = 3
"""Exit status of a process that stopped because a peer process was lost."""

_PREFIX = "jgrpo"


@dataclasses.dataclass(frozen=True)
class ProcessSpec:
    """How this process joins the pod (None fields: jax detects them from the cluster)."""

    coordinator: Optional[str]
    """HOST:PORT of process 0's coordination service."""
    num_processes: Optional[int]
    process_id: Optional[int]
    source: str
    """Where the spec came from: flags, env, slurm, ompi, jax-env (for messages)."""
    peer_timeout_s: float = DEFAULT_PEER_TIMEOUT_S
    """A peer silent this long is lost (the watchdog ends the run)."""
    local_device_ids: Optional[tuple[int, ...]] = None
    """GPUs this process owns (None: jax's choice, all visible ones outside SLURM)."""


def _int_or_error(value: str, name: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}: expected an integer, got {value!r}") from None


def _check_coordinator(address: str, name: str) -> None:
    host, sep, port = address.rpartition(":")
    if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
        raise ConfigError(f"{name}: expected HOST:PORT, got {address!r}")


def resolve_spec(
    coordinator: Optional[str] = None,
    num_processes: Optional[int] = None,
    process_id: Optional[int] = None,
    peer_timeout_s: Optional[float] = None,
    environ: Optional[Mapping[str, str]] = None,
) -> Optional[ProcessSpec]:
    """The pod this process belongs to, or None for a single process; first match wins:
    1. the CLI flags `--coordinator HOST:PORT --num-processes N --process-id I`;
    2. the environment `JGRPO_COORDINATOR`, `JGRPO_NUM_PROCESSES`, `JGRPO_PROCESS_ID`;
    3. a cluster `jax.distributed.initialize()` detects by itself: SLURM with more than one
       task (the coordinator is the step's first node, port derived from the job id), Open MPI
       (`OMPI_COMM_WORLD_SIZE` > 1), or `JAX_COORDINATOR_ADDRESS` set;
    4. otherwise a single process (None). A partial spec is a ConfigError."""
    env = os.environ if environ is None else environ
    if peer_timeout_s is None:
        raw = env.get(ENV_PEER_TIMEOUT)
        peer_timeout_s = float(raw) if raw else DEFAULT_PEER_TIMEOUT_S
    if peer_timeout_s <= 0:
        raise ConfigError(f"--peer-timeout: must be > 0 seconds, got {peer_timeout_s}")
    spec = None
    flags = (coordinator, num_processes, process_id)
    if any(x is not None for x in flags):
        names = ("--coordinator", "--num-processes", "--process-id")
        missing = [n for n, x in zip(names, flags) if x is None]
        if missing:
            raise ConfigError(f"{missing[0]}: missing; a pod needs all of {', '.join(names)}")
        spec = ProcessSpec(coordinator, num_processes, process_id, "flags")
    elif any(k in env for k in (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)):
        names = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
        missing = [n for n in names if n not in env]
        if missing:
            raise ConfigError(f"{missing[0]}: missing; a pod needs all of {', '.join(names)}")
        spec = ProcessSpec(
            env[ENV_COORDINATOR],
            _int_or_error(env[ENV_NUM_PROCESSES], ENV_NUM_PROCESSES),
            _int_or_error(env[ENV_PROCESS_ID], ENV_PROCESS_ID),
            "env",
        )
    elif "SLURM_JOB_ID" in env and int(env.get("SLURM_NTASKS", "1") or 1) > 1:
        spec = ProcessSpec(None, None, None, "slurm", local_device_ids=_slurm_gpus(env))
    elif int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1:
        spec = ProcessSpec(None, None, None, "ompi")
    elif env.get("JAX_COORDINATOR_ADDRESS"):
        spec = ProcessSpec(None, None, None, "jax-env")
    if spec is None:
        return None
    if spec.source in ("flags", "env"):
        where = "--" if spec.source == "flags" else ""
        _check_coordinator(spec.coordinator, f"{where}coordinator" if where else ENV_COORDINATOR)
        if spec.num_processes < 1:
            raise ConfigError(f"num-processes: must be >= 1, got {spec.num_processes}")
        if not 0 <= spec.process_id < spec.num_processes:
            raise ConfigError(
                f"process-id: must be in [0, {spec.num_processes}), got {spec.process_id}"
            )
    return dataclasses.replace(spec, peer_timeout_s=float(peer_timeout_s))


def _slurm_gpus(env: Mapping[str, str]) -> Optional[tuple[int, ...]]:
    """With one task per node, all the node's GPUs: jax's SLURM detection would otherwise bind
    each process to the single GPU numbered by its SLURM_LOCALID (its one-process-per-GPU
    layout, kept when there are several tasks per node)."""
    per_node = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_STEP_TASKS_PER_NODE", "")
    gpus = env.get("SLURM_GPUS_ON_NODE", "")
    if per_node.split("(")[0] != "1" or not gpus.isdigit():
        return None
    return tuple(range(int(gpus)))


# ----------------------------------------------------------------------------- start-up


class _Pod:
    """The live pod of this process (set by `initialize`)."""

    def __init__(self, client, spec: ProcessSpec, process_id: int, num_processes: int):
        self.client = client
        self.spec = spec
        self.process_id = process_id
        self.num_processes = num_processes
        self.round = 0
        self.hosts: dict[int, str] = {}
        self.checkpoint_dir: Optional[Path] = None
        self.latest_step: Callable[[Path], Optional[int]] = lambda directory: None
        self.stop = threading.Event()
        self.watchdog: Optional[threading.Thread] = None


_POD: Optional[_Pod] = None


def initialize(spec: Optional[ProcessSpec]) -> None:
    """Join the pod (jax.distributed) and start the watchdog; no-op for `None`.

    Must run before anything touches a device."""
    global _POD
    if spec is None or _POD is not None:
        return
    import jax
    from jax._src import distributed as jax_distributed  # the live client (no public handle)

    if os.environ.get("JAX_PLATFORMS", "").startswith("cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    heartbeat = max(int(3 * spec.peer_timeout_s), 10)
    try:
        jax.distributed.initialize(
            coordinator_address=spec.coordinator,
            num_processes=spec.num_processes,
            process_id=spec.process_id,
            local_device_ids=None if spec.local_device_ids is None else list(spec.local_device_ids),
            initialization_timeout=max(int(spec.peer_timeout_s * 5), 60),
            heartbeat_timeout_seconds=heartbeat,
            shutdown_timeout_seconds=heartbeat,
        )
    except (ValueError, RuntimeError) as e:  # jax: what it could not detect, or a lost contact
        raise ConfigError(f"jax.distributed ({spec.source}): {str(e).splitlines()[0]}") from e
    client = jax_distributed.global_state.client
    _POD = _Pod(client, spec, jax.process_index(), jax.process_count())
    _POD.watchdog = threading.Thread(target=_watch, args=(_POD,), name="jgrpo-watchdog")
    _POD.watchdog.daemon = True
    _POD.watchdog.start()
    hosts = allgather(socket.gethostname().encode(), raw=True)
    _POD.hosts = {i: h.decode() for i, h in enumerate(hosts)}


def is_multiprocess() -> bool:
    return _POD is not None and _POD.num_processes > 1


def process_index() -> int:
    return _POD.process_id if _POD is not None else 0


def process_count() -> int:
    return _POD.num_processes if _POD is not None else 1


def is_primary() -> bool:
    """Process 0: the only writer of metrics, plots, summaries and console progress."""
    return process_index() == 0


def process_slice(n: int) -> tuple[int, int]:
    """[lo, hi) of this process's contiguous part of `n` items (sizes differ by at most 1)."""
    p, i = process_count(), process_index()
    bounds = [j * n // p for j in range(p + 1)]
    return bounds[i], bounds[i + 1]


def watch_checkpoints(directory: str | Path, latest_step: Callable[[Path], Optional[int]]) -> None:
    """Name this folder's newest complete checkpoint in a lost-peer message; `latest_step`
    (jgrpo.checkpoint.latest_complete_step) finds it, called only when a peer is lost."""
    if _POD is not None:
        _POD.checkpoint_dir = Path(directory)
        _POD.latest_step = latest_step


def finish() -> None:
    """Mark this process as done (its peers stop watching it) and stop the watchdog."""
    if _POD is None:
        return
    _POD.stop.set()
    try:
        _POD.client.key_value_set(f"{_PREFIX}/done/{_POD.process_id}", "1", allow_overwrite=True)
    except Exception:  # noqa: BLE001 - the coordinator may already be gone at exit
        pass


def abort(exit_code: int) -> None:
    """End this process after an error, skipping jax.distributed's shutdown barrier (which
    would wait for peers still blocked on this one); its peers' watchdogs report it lost.

    It first waits one peer timeout: when the error came from a peer's death (a collective
    that failed with it), the watchdog ends the process with the message naming that peer."""
    sys.stdout.flush()
    sys.stderr.flush()
    if _POD is not None:
        time.sleep(_POD.spec.peer_timeout_s + 2.0)
        _POD.stop.set()
    os._exit(exit_code)


def barrier(name: str) -> None:
    """All processes reach this point (a gather of nothing; `name` is for reading the code)."""
    del name
    allgather(b"", raw=True)


def align_first_runs(jitted):
    """`jitted` (a jax.jit function), called so that every process starts a new program together.

    A program's first run builds the communicators of its cross-host collectives (gloo on CPU,
    NCCL on GPU), and gloo gives up when a peer is 30 s late to that (not configurable). One
    host may compile a program much longer than another (a compile-cache miss, a busy machine),
    so on a pod each new input signature is compiled ahead of time on every process, the
    processes meet at a barrier, then run it. One process: `jitted` itself."""
    if not is_multiprocess():
        return jitted
    import jax

    compiled: dict = {}

    def call(*args):
        leaves, treedef = jax.tree.flatten(args)
        key = (treedef, tuple((x.shape, str(x.dtype)) for x in leaves))
        if key not in compiled:
            compiled[key] = jitted.lower(*args).compile()
            barrier("compiled")
        return compiled[key](*args)

    return call


class PeerLost(RuntimeError):
    """A peer process (or the coordinator) stopped answering."""


# ----------------------------------------------------------------------------- host gathers


def _to_bytes(value: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.asarray(value), allow_pickle=False)
    return buf.getvalue()


def _get(pod: _Pod, key: str, sender: int) -> bytes:
    """Wait for `key` as long as the watchdog sees `sender` alive (a slow peer is not a dead
    one: a first compile of a large model can take minutes; the watchdog ends a dead one)."""
    while True:
        try:
            return pod.client.blocking_key_value_get_bytes(key, int(pod.spec.peer_timeout_s * 1e3))
        except Exception as e:  # noqa: BLE001 - JaxRuntimeError: DEADLINE_EXCEEDED / UNAVAILABLE
            alive = pod.watchdog is not None and pod.watchdog.is_alive()
            if "DEADLINE_EXCEEDED" not in str(e) or not alive:
                raise PeerLost(
                    f"waiting for process {sender} ({pod.hosts.get(sender, '?')}): "
                    f"{str(e).splitlines()[0]}"
                ) from e


def allgather(value, *, raw: bool = False) -> list:
    """Every process's `value` (a numpy array, or bytes with raw=True), in process order.

    Small host data only (it travels through the coordinator's key-value store). Every process
    must call it the same number of times in the same order."""
    if not is_multiprocess():
        return [value]
    pod = _POD
    pod.round += 1
    key = f"{_PREFIX}/gather/{pod.round}"
    pod.client.key_value_set_bytes(f"{key}/{pod.process_id}", value if raw else _to_bytes(value))
    out = []
    for i in range(pod.num_processes):
        got = _get(pod, f"{key}/{i}", i)
        out.append(got if raw else np.load(io.BytesIO(got), allow_pickle=False))
    # Everyone has set round r, so everyone finished reading round r - 1: drop our old key.
    if pod.round > 1:
        try:
            pod.client.key_value_delete(f"{_PREFIX}/gather/{pod.round - 1}/{pod.process_id}")
        except Exception:  # noqa: BLE001 - only a leak in the coordinator
            pass
    return out


def allgather_rows(rows: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Concatenate each key's per-process row arrays in process order (the global batch order).

    One gather; a process with no rows passes an empty mapping."""
    if not is_multiprocess():
        return {k: np.asarray(v) for k, v in rows.items()}
    buf = io.BytesIO()
    np.savez(buf, **{k: np.asarray(v) for k, v in rows.items()})
    parts = []
    for blob in allgather(buf.getvalue(), raw=True):
        with np.load(io.BytesIO(blob), allow_pickle=False) as z:
            parts.append({k: z[k] for k in z.files})
    parts = [p for p in parts if p]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


# ----------------------------------------------------------------------------- watchdog


def _latest_checkpoint(pod: _Pod) -> str:
    if pod.checkpoint_dir is None:
        return "no checkpoint folder"
    step = pod.latest_step(pod.checkpoint_dir)
    return "no complete checkpoint yet" if step is None else f"latest complete checkpoint: {step}"


def _die(pod: _Pod, lost: int, why: str) -> None:
    host = pod.hosts.get(lost, "?")
    print(
        f"jgrpo: error: lost peer: process {lost} of {pod.num_processes} (host {host}) {why}; "
        f"stopping process {pod.process_id}; {_latest_checkpoint(pod)} in "
        f"{pod.checkpoint_dir}; restart every process with --resume",
        file=sys.stderr,
        flush=True,
    )
    os._exit(EXIT_LOST_PEER)


def _watch(pod: _Pod, interval_s: float = 1.0) -> None:
    """Heartbeat our counter; end the process when a peer's counter stops moving.

    jax's coordination service aborts a pod whose peer stopped heartbeating only with a C++
    check failure, and a process blocked in a collective with a dead peer may never see a
    Python exception. So every `interval_s` each process bumps its counter in the key-value
    store and reads its peers'; one not moving for peer_timeout_s (or a coordinator that no
    longer answers) ends this process with `os._exit(EXIT_LOST_PEER)` (a hung collective
    cannot be interrupted any other way); jax's own heartbeat timeout (3 x peer_timeout_s) stays
    the backstop. A process that finishes marks itself done first (:func:`finish`). When
    process 0 (the coordinator) dies, jax's error polling usually ends the others first (exit
    134). A dead host's state cannot be saved: resume from the last periodic checkpoint."""
    timeout = pod.spec.peer_timeout_s
    peers = [i for i in range(pod.num_processes) if i != pod.process_id]
    last_seen = {i: (None, time.monotonic()) for i in peers}
    beat = 0
    while not pod.stop.wait(interval_s):
        beat += 1
        try:
            pod.client.key_value_set(
                f"{_PREFIX}/heartbeat/{pod.process_id}", str(beat), allow_overwrite=True
            )
        except Exception as e:  # noqa: BLE001 - the coordinator (process 0) is gone
            if pod.stop.is_set():
                return
            _die(
                pod,
                0,
                f"(the coordinator {pod.spec.coordinator or ''}) stopped answering: "
                f"{str(e).splitlines()[0][:200]}",
            )
        now = time.monotonic()
        for i in list(peers):
            try:
                pod.client.key_value_try_get(f"{_PREFIX}/done/{i}")
                peers.remove(i)  # finished normally: its silence is not a death
                continue
            except Exception:  # noqa: BLE001 - NOT_FOUND: still running
                pass
            try:
                value = pod.client.key_value_try_get(f"{_PREFIX}/heartbeat/{i}")
            except Exception:  # noqa: BLE001 - NOT_FOUND: no beat yet
                value = None
            seen, since = last_seen[i]
            if value != seen:
                last_seen[i] = (value, now)
            elif now - since > timeout and not pod.stop.is_set():
                silent = f"sent no heartbeat for {now - since:.0f} s (--peer-timeout {timeout:g})"
                _die(pod, i, silent)
