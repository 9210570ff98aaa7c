"""Multi-host pods: the process spec, and a real 2-process pod on one machine vs one process.

The pod tests (heavy: make test-all) run `jgrpo train` as subprocesses: each sets its own
fake CPU device count (4 per process on the pod, 8 for the one-process reference) and joins a
loopback coordinator with gloo collectives, exactly as hosts of a GPU pod join process 0. The
one-process reference run starts once for the module, alongside the first pod; the Ray pod's
processes join the session's local Ray cluster (conftest) by its address, as a pod's hosts join
one cluster.
"""

import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import SPLITTING_AGENT, xla_flags
from flax import nnx

from jgrpo import distributed
from jgrpo.checkpoint import latest_complete_step
from jgrpo.cli import main
from jgrpo.config import ConfigError
from jgrpo.metrics import read_metrics
from jgrpo.models import from_pretrained
from jgrpo.models.sources import resolve_model_path

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")


# ----------------------------------------------------------------------------- the spec


def test_flags_win_over_env_and_slurm():
    env = {"JGRPO_COORDINATOR": "h:1", "JGRPO_NUM_PROCESSES": "4", "JGRPO_PROCESS_ID": "3"}
    env |= {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "8"}
    spec = distributed.resolve_spec("10.0.0.1:1234", 2, 1, environ=env)
    assert (spec.coordinator, spec.num_processes, spec.process_id, spec.source) == (
        "10.0.0.1:1234",
        2,
        1,
        "flags",
    )
    spec = distributed.resolve_spec(environ=env | {"JGRPO_PEER_TIMEOUT": "7"})
    assert (spec.coordinator, spec.num_processes, spec.process_id) == ("h:1", 4, 3)
    assert (spec.source, spec.peer_timeout_s) == ("env", 7.0)


def test_clusters_jax_detects_and_a_single_process():
    slurm = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "8", "SLURM_PROCID": "2"}
    assert distributed.resolve_spec(environ=slurm).source == "slurm"
    assert distributed.resolve_spec(environ={"OMPI_COMM_WORLD_SIZE": "2"}).source == "ompi"
    assert distributed.resolve_spec(environ={"JAX_COORDINATOR_ADDRESS": "h:9"}).source == "jax-env"
    # one task per node owns all the node's GPUs (jax alone would give it GPU SLURM_LOCALID)
    per_node = {"SLURM_NTASKS_PER_NODE": "1", "SLURM_GPUS_ON_NODE": "4", "SLURM_LOCALID": "0"}
    assert distributed.resolve_spec(environ=slurm | per_node).local_device_ids == (0, 1, 2, 3)
    per_gpu = per_node | {"SLURM_NTASKS_PER_NODE": "4"}
    assert distributed.resolve_spec(environ=slurm | per_gpu).local_device_ids is None
    # a one-task SLURM job and a laptop: no jax.distributed at all
    assert distributed.resolve_spec(environ=slurm | {"SLURM_NTASKS": "1"}) is None
    assert distributed.resolve_spec(environ={}) is None


@pytest.mark.parametrize(
    "flags, message",
    [
        ((None, 2, 0), "--coordinator: missing"),
        (("h:1", 2, None), "--process-id: missing"),
        (("nohost", 2, 0), "--coordinator: expected HOST:PORT"),
        (("h:1", 2, 2), r"process-id: must be in \[0, 2\)"),
    ],
)
def test_partial_or_bad_specs_raise_one_line(flags, message):
    with pytest.raises(ConfigError, match=message):
        distributed.resolve_spec(*flags, environ={})


def test_cli_rejects_a_partial_pod_before_any_model_loads(capsys, tmp_path):
    argv = ["train", "--config", TINY, "--run-dir", str(tmp_path / "r"), "--num-processes", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "jgrpo: error: --coordinator: missing; a pod needs all of --coordinator, "
        "--num-processes, --process-id"
    ]
    assert not (tmp_path / "r").exists()


def test_a_pod_with_ray_rollout_needs_one_cluster_address():
    from jgrpo.config import load_config
    from jgrpo.train import check_pod

    with pytest.raises(ConfigError, match=r"^rollout.ray_address: a pod's Ray rollout needs one"):
        check_pod(load_config(TINY, ["rollout.backend=ray"]), 2)
    check_pod(load_config(TINY, ["rollout.backend=ray", "rollout.ray_address=h:6379"]), 2)
    check_pod(load_config(TINY, ["rollout.backend=ray"]), 1)  # one process: a local cluster


@pytest.mark.parametrize("env,threads", [({}, 32), ({"PJRT_NPROC": "12"}, 12)])
def test_fake_cpu_devices_get_four_pool_threads_each(env, threads):
    """8 fake CPU devices: importing jgrpo gives XLA:CPU's thread pool 4 threads per device (a
    device waiting in a collective holds a thread; with one per device the pool ran dry and the
    process deadlocked), unless the user chose PJRT_NPROC."""
    probe = (
        "import os, jgrpo, jax.numpy as jnp; jnp.ones(2).block_until_ready(); "
        "print(sum(open(f'/proc/self/task/{t}/comm').read().startswith('tf_XLAEigen') "
        "for t in os.listdir('/proc/self/task')))"
    )
    run_env = {k: v for k, v in os.environ.items() if k != "PJRT_NPROC"}
    run_env |= {"XLA_FLAGS": xla_flags(8), "JAX_PLATFORMS": "cpu", **env}
    out = subprocess.run(
        [sys.executable, "-c", probe], env=run_env, capture_output=True, text=True, check=True
    )
    assert int(out.stdout.split()[-1]) == threads, out.stderr[-2000:]


def test_process_slices_cover_the_step_in_order(monkeypatch):
    pod = distributed._Pod(None, distributed.ProcessSpec("h:1", 3, 0, "flags"), 0, 3)
    slices = []
    for i in range(3):
        pod.process_id = i
        monkeypatch.setattr(distributed, "_POD", pod)
        slices.append(distributed.process_slice(8))
    assert slices == [(0, 2), (2, 5), (5, 8)]


class FakeKV:
    """The coordination service's key-value store, in memory (what the watchdog talks to)."""

    def __init__(self):
        self.data = {}

    def key_value_set(self, key, value, allow_overwrite=False):
        self.data[key] = value

    def key_value_try_get(self, key):
        if key not in self.data:
            raise RuntimeError(f"NOT_FOUND: {key}")
        return self.data[key]


def test_watchdog_names_the_silent_peer_and_spares_a_finished_one(monkeypatch):
    kv = FakeKV()
    kv.data["jgrpo/done/2"] = "1"  # process 2 finished normally: silent, but not lost
    kv.data["jgrpo/heartbeat/1"] = "5"  # process 1 beat once, then went silent
    spec = distributed.ProcessSpec("h:1", 3, 0, "flags", peer_timeout_s=0.3)
    pod = distributed._Pod(kv, spec, 0, 3)
    pod.hosts = {1: "node-b"}
    lost = []

    def die(pod_, peer, why):
        lost.append((peer, why))
        pod_.stop.set()

    monkeypatch.setattr(distributed, "_die", die)
    start = time.monotonic()
    distributed._watch(pod, interval_s=0.05)
    assert [peer for peer, _ in lost] == [1]
    assert "no heartbeat" in lost[0][1] and 0.3 <= time.monotonic() - start < 5
    assert kv.data["jgrpo/heartbeat/0"] != "0"  # it beat its own counter meanwhile


def test_watchdog_reports_a_lost_coordinator_as_process_0(monkeypatch):
    class GoneKV(FakeKV):
        def key_value_set(self, key, value, allow_overwrite=False):
            raise RuntimeError("UNAVAILABLE: Socket closed")

    spec = distributed.ProcessSpec("h:1", 2, 1, "flags", peer_timeout_s=5.0)
    pod = distributed._Pod(GoneKV(), spec, 1, 2)
    lost = []
    monkeypatch.setattr(
        distributed, "_die", lambda p, peer, why: (lost.append((peer, why)), p.stop.set())
    )
    distributed._watch(pod, interval_s=0.01)
    assert lost[0][0] == 0 and "coordinator h:1" in lost[0][1]


def test_lost_peer_line_names_the_checkpoint_the_caller_finds(monkeypatch, tmp_path):
    """distributed.py knows no checkpoint format: the trainer passes how to find the newest."""
    pod = distributed._Pod(None, distributed.ProcessSpec("h:1", 2, 0, "flags"), 0, 2)
    assert distributed._latest_checkpoint(pod) == "no checkpoint folder"
    monkeypatch.setattr(distributed, "_POD", pod)
    seen = []
    distributed.watch_checkpoints(tmp_path, lambda d: seen.append(d) or 7)
    assert seen == []  # looked up only when a peer is lost
    assert distributed._latest_checkpoint(pod) == "latest complete checkpoint: 7"
    assert seen == [tmp_path]
    distributed.watch_checkpoints(tmp_path, lambda d: None)
    assert distributed._latest_checkpoint(pod) == "no complete checkpoint yet"


# ----------------------------------------------------------------------------- a real pod

# Every group gets reward variance (a length reward), so losses and gradients are not 0.
REWARD = (
    "def length(prompts, completions, **kwargs):\n    return [len(c) / 8.0 for c in completions]\n"
)
# fsdp=2 within each host: parameters sharded on the pod, each host samples with its replica.
OVERRIDES = [
    "mesh.data=4",
    "mesh.fsdp=2",
    "grpo.max_num_steps=3",
    "grpo.val_at_start=false",
    "checkpoint.save_period=1",
    "logging.tensorboard=false",
    "data.reward_functions=[{function: 'pod_rewards:length', weight: 0.5}]",
]
COMPARED = ("loss/pg", "loss/total", "train/grad_norm", "reward/mean", "advantage/std")
PEER_TIMEOUT = 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory):
    """One compilation cache for the module's runs: resumed runs reuse the first runs' programs."""
    return tmp_path_factory.mktemp("jax_cache")


def _launch(
    tmp_path, run_dir, num_processes, *extra, cache=None, overrides=OVERRIDES
) -> list[subprocess.Popen]:
    """`jgrpo train` on `num_processes` processes x (8 / num_processes) fake CPU devices."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = xla_flags(8 // num_processes)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(tmp_path)])
    env["JAX_COMPILATION_CACHE_DIR"] = str(cache or tmp_path / "jax_cache")
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    base = [sys.executable, "-m", "jgrpo.cli", "train", "--config", TINY, "--run-dir", run_dir]
    pod = []
    if num_processes > 1:
        port = _free_port()
        pod = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(num_processes)]
        pod += ["--peer-timeout", str(PEER_TIMEOUT)]
    procs = []
    for i in range(num_processes):
        ident = ["--process-id", str(i)] if num_processes > 1 else []
        log = open(tmp_path / f"{Path(run_dir).name}.{i}.log", "w")
        cmd = [*base, *pod, *ident, *extra, *overrides]
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def _wait(procs, timeout=600) -> list[int]:
    """The exit codes; a process still running when waiting fails (a timeout) is killed."""
    try:
        return [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def _log(tmp_path, run_dir, i) -> str:
    return (tmp_path / f"{Path(run_dir).name}.{i}.log").read_text()


def _assert_same_metrics(rows, reference, steps):
    by_step = {r["step"]: r for r in rows}
    ref = {r["step"]: r for r in reference}
    for s in steps:
        for key in COMPARED:
            assert by_step[s][key] == pytest.approx(ref[s][key], abs=1e-5), (s, key)
    # validation at the end is the pod's global accuracy, not process 0's slice
    assert by_step[3]["val/accuracy"] == ref[3]["val/accuracy"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, jax_cache):
    """The one-process run (1 x 8 devices, local backend): started when first asked for, so it
    runs alongside that test's pod; call the fixture's value to wait for its metrics."""
    tmp = tmp_path_factory.mktemp("reference")
    (tmp / "pod_rewards.py").write_text(REWARD)
    one = str(tmp / "one")
    procs = _launch(tmp, one, 1, cache=jax_cache)

    @functools.cache
    def metrics():
        assert _wait(procs) == [0], _log(tmp, one, 0)[-3000:]
        rows = read_metrics(one)
        assert [r["step"] for r in rows] == [1, 2, 3]
        assert all(r["train/grad_norm"] > 0.1 for r in rows)  # nothing compared is trivially 0
        assert abs(rows[1]["loss/total"]) > 1e-3 and abs(rows[2]["loss/total"]) > 1e-3
        return rows

    yield metrics
    for p in procs:
        if p.poll() is None:
            p.kill()


@pytest.mark.heavy
def test_two_process_pod_matches_one_process_and_resumes_after_a_lost_host(
    tmp_path, reference, jax_cache
):
    (tmp_path / "pod_rewards.py").write_text(REWARD)
    pod = str(tmp_path / "pod")
    pod_procs = _launch(tmp_path, pod, 2, cache=jax_cache)

    # Kill process 1 once step 1 is checkpointed: process 0 must stop within a bound, naming it.
    deadline = time.monotonic() + 500
    while latest_complete_step(Path(pod) / "checkpoints") is None:
        assert time.monotonic() < deadline and pod_procs[1].poll() is None, _log(tmp_path, pod, 0)
        time.sleep(0.2)
    pod_procs[1].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    rc0 = pod_procs[0].wait(timeout=120)
    stopped_s = time.monotonic() - killed_at
    survivor = _log(tmp_path, pod, 0)
    assert rc0 == distributed.EXIT_LOST_PEER, survivor[-3000:]
    assert "lost peer: process 1 of 2" in survivor
    assert stopped_s < PEER_TIMEOUT + 30

    # The pod's checkpoint of step 1 (2 processes x 4 devices), also resumed by 1 x 8 devices.
    resumed_step = latest_complete_step(Path(pod) / "checkpoints")
    cross = str(tmp_path / "cross")
    shutil.copytree(pod, cross)
    pod_procs = _launch(tmp_path, pod, 2, "--resume", cache=jax_cache)
    cross_procs = _launch(tmp_path, cross, 1, "--resume", cache=jax_cache)
    assert _wait(pod_procs) == [0, 0], _log(tmp_path, pod, 0)[-3000:] + _log(tmp_path, pod, 1)
    assert _wait(cross_procs) == [0], _log(tmp_path, cross, 0)[-3000:]

    rows = read_metrics(pod)
    assert [r["step"] for r in rows] == [1, 2, 3]  # one line per step across the pod
    _assert_same_metrics(rows, reference(), steps=[1, 2, 3])
    _assert_same_metrics(read_metrics(cross), reference(), steps=range(resumed_step + 1, 4))


@pytest.mark.heavy
def test_two_process_pod_with_ray_rollout_matches_one_process(
    tmp_path, reference, jax_cache, ray_cluster
):
    """rollout.backend=ray on the pod: each process drives one worker in the shared cluster
    for its slice of the prompts and publishes only its half of the weights; the losses are
    those of the one-process local run (which equals a one-process Ray run row for row)."""
    (tmp_path / "pod_rewards.py").write_text(REWARD)
    pod = str(tmp_path / "pod")
    ray_args = ["rollout.backend=ray", f"rollout.ray_address={ray_cluster}"]
    procs = _launch(tmp_path, pod, 2, *ray_args, "rollout.num_workers=1", cache=jax_cache)
    codes = _wait(procs, timeout=900)
    assert codes == [0, 0], _log(tmp_path, pod, 0)[-3000:] + _log(tmp_path, pod, 1)
    rows = read_metrics(pod)
    assert [r["step"] for r in rows] == [1, 2, 3]  # one line per step across the pod
    _assert_same_metrics(rows, reference(), steps=[1, 2, 3])
    # process 0 sent its share of the weights: half the model, give or take one leaf
    leaves = jax.tree.leaves(nnx.state(from_pretrained(resolve_model_path("builtin:tiny-qwen2"))))
    total, biggest = sum(x.nbytes for x in leaves), max(x.nbytes for x in leaves)
    for r in rows:
        assert (total - biggest) / 2 <= r["rollout/weight_mb"] * 2**20 <= (total + biggest) / 2
        assert r["rollout/staleness_max"] == 0.0 and r["rollout/worker_failures"] == 0.0


@pytest.mark.heavy  # make test: test_reward_model's 2x2x2-mesh scores and Ray-worker scoring
def test_two_process_pod_with_a_reward_model_matches_one_process(tmp_path, jax_cache):
    """A reward model on a pod (local backend): each process loads a replica on its own
    devices (its host's rows of the mesh, data 2 x fsdp 2) and scores its own rows (a model on
    the global mesh could not: each process feeds different texts); the run equals one
    process on all 8 devices, which scores every row."""
    from conftest import build_reward_model

    (tmp_path / "pod_rewards.py").write_text(REWARD)
    rm = build_reward_model(tmp_path / "rm", "qwen2")
    terms = (
        f"data.reward_functions=[{{model: '{rm}', name: judge, batch_tokens: 256}}, "
        "{function: 'pod_rewards:length', weight: 0.5}]"
    )
    overrides = [*(o for o in OVERRIDES if not o.startswith("data.reward_")), terms]
    one, pod = str(tmp_path / "one"), str(tmp_path / "pod")
    procs = _launch(tmp_path, one, 1, cache=jax_cache, overrides=overrides)
    procs += _launch(tmp_path, pod, 2, cache=jax_cache, overrides=overrides)
    codes = _wait(procs, timeout=900)
    logs = [_log(tmp_path, one, 0), _log(tmp_path, pod, 0), _log(tmp_path, pod, 1)]
    assert codes == [0, 0, 0], "\n".join(log[-2000:] for log in logs)
    reference, rows = read_metrics(one), read_metrics(pod)
    assert [r["step"] for r in rows] == [r["step"] for r in reference] == [1, 2, 3]
    for r, ref in zip(rows, reference):
        assert ref["train/grad_norm"] > 0.1  # nonzero advantages: nothing trivially equal
        for key in (*COMPARED, "reward/judge/mean", "reward/length/mean"):
            assert r[key] == pytest.approx(ref[key], abs=1e-5), (r["step"], key)


# ----------------------------------------------------------------------------- dynamic sampling

EXCHANGE_SCRIPT = """
import sys

import numpy as np

from jgrpo import distributed

coordinator, me, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
distributed.initialize(distributed.ProcessSpec(coordinator, 2, me, "flags", peer_timeout_s=30))
from jgrpo import sharding
from jgrpo.config import MeshConfig
from jgrpo.rollout.exchange import exchange_rows

mesh = sharding.make_mesh(MeshConfig(data=4, fsdp=2))
rows = (5, 3)[me]  # the hosts generated different numbers of rows
local = {
    "x": (np.arange(rows * 3).reshape(rows, 3) + 100 * me).astype(np.int32),
    "flag": np.arange(rows) % 2 == me,
    "terms": np.zeros((rows, 0), np.float32),
}
source = np.array([1, 0, 1, 1, 0, 0, 1, 0])
index = np.array([2, 4, 0, 1, 0, 3, 2, 1])
got, positions = exchange_rows(local, source, index, mesh)
np.savez(out, positions=positions, **got)
distributed.finish()
"""


def test_rows_move_between_two_processes_through_the_devices(tmp_path):
    """Dynamic sampling on a pod: the rows a host feeds may have been generated on another.
    Each of 2 processes (4 devices each) gets its rows of the picked batch, with positions."""
    (tmp_path / "exchange.py").write_text(EXCHANGE_SCRIPT)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env["XLA_FLAGS"] = xla_flags(4)
    coordinator = f"127.0.0.1:{_free_port()}"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(tmp_path / "exchange.py"),
                coordinator,
                str(i),
                str(tmp_path / f"{i}.npz"),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=300)[0].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    x = {h: np.arange(n * 3).reshape(n, 3) + 100 * h for h, n in ((0, 5), (1, 3))}
    flag = {h: np.arange(n) % 2 == h for h, n in ((0, 5), (1, 3))}
    source = [1, 0, 1, 1, 0, 0, 1, 0]
    index = [2, 4, 0, 1, 0, 3, 2, 1]
    seen = []
    for i in range(2):
        with np.load(tmp_path / f"{i}.npz") as got:
            assert len(got["positions"]) == 4 and got["terms"].shape == (4, 0)
            for row, b in enumerate(got["positions"]):
                np.testing.assert_array_equal(got["x"][row], x[source[b]][index[b]])
                assert got["flag"][row] == flag[source[b]][index[b]]
            seen += list(got["positions"])
    assert sorted(seen) == list(range(8))


FLAT_HALF_REWARD = (  # half the prompts score 0 on every completion: all-equal groups
    "import zlib\n\n"
    "def length(prompts, completions, **kwargs):\n"
    "    return [0.0 if zlib.crc32(p.encode()) % 2 else len(c) / 8.0\n"
    "            for p, c in zip(prompts, completions)]\n"
)


@pytest.mark.heavy  # in make test: test_rows_move_between_two_processes_through_the_devices
def test_two_process_pod_with_dynamic_sampling_matches_one_process(tmp_path, jax_cache):
    """Every host draws the same extra prompts, keeps the same informative groups and feeds its
    rows of them (generated on either host): the one-process run's losses and counts."""
    (tmp_path / "pod_rewards.py").write_text(FLAT_HALF_REWARD)
    ds = "grpo.use_dynamic_sampling=true"
    one, pod = str(tmp_path / "one"), str(tmp_path / "pod")
    procs = _launch(tmp_path, one, 1, ds, cache=jax_cache)
    procs += _launch(tmp_path, pod, 2, ds, cache=jax_cache)
    codes = _wait(procs, timeout=900)
    logs = [_log(tmp_path, one, 0), _log(tmp_path, pod, 0), _log(tmp_path, pod, 1)]
    assert codes == [0, 0, 0], "\n".join(log[-3000:] for log in logs)
    reference, rows = read_metrics(one), read_metrics(pod)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert max(r["dynamic_sampling/gen_batches"] for r in reference) > 1
    assert all(r["train/grad_norm"] > 0.01 for r in reference)  # nothing compared is 0
    _assert_same_metrics(rows, reference, steps=[1, 2, 3])
    counts = ("dynamic_sampling/", "batch/frac_reward_zero_std", "reward/frac_groups_all_equal")
    pick = lambda rs: [{k: v for k, v in r.items() if k.startswith(counts)} for r in rs]  # noqa: E731
    assert pick(rows) == pick(reference)


@pytest.mark.heavy  # make test: test_router_replay's float32 proof on one process
def test_two_process_moe_pod_with_router_replay_matches_one_process(tmp_path, jax_cache):
    """An MoE model (experts sharded over fsdp) with model.moe.router_replay: each host's
    sampler records the experts of its rows, the pod's step replays them; the one-process
    run's losses, and no routing mismatch (float32)."""
    (tmp_path / "pod_rewards.py").write_text(REWARD)
    moe = ["model.path=builtin:tiny-qwen3-moe", "model.moe.router_replay=true"]
    one, pod = str(tmp_path / "one"), str(tmp_path / "pod")
    procs = _launch(tmp_path, one, 1, *moe, cache=jax_cache)
    procs += _launch(tmp_path, pod, 2, *moe, cache=jax_cache)
    codes = _wait(procs, timeout=900)
    logs = [_log(tmp_path, one, 0), _log(tmp_path, pod, 0), _log(tmp_path, pod, 1)]
    assert codes == [0, 0, 0], "\n".join(log[-3000:] for log in logs)
    reference, rows = read_metrics(one), read_metrics(pod)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["train/grad_norm"] > 0.01 for r in reference)  # nothing compared is 0
    _assert_same_metrics(rows, reference, steps=[1, 2, 3])
    for r in rows + reference:
        assert r["moe/routing_mismatch"] == 0.0
        assert r["logprob/token_mult_prob_error"] <= 1.001


# ----------------------------------------------------------------------------- agents


@pytest.mark.heavy  # make test: test_agents' endpoint tests and the joins' hand values
def test_two_process_pod_with_an_agent_matches_one_process(tmp_path, jax_cache):
    """data.agent on a pod: each host runs its rows' agents against its own endpoint and pads
    its rows to the other host's count; the run equals one process serving every row (split
    rollouts included), and the hosts' sampler calls add up."""
    (tmp_path / "pod_agent.py").write_text(SPLITTING_AGENT)
    agent = [
        "model.path=builtin:tiny-qwen2-chat",
        "data.agent=pod_agent:agent",
        "rollout.max_new_tokens=24",
        "rollout.max_turns=2",
    ]
    overrides = [*(o for o in OVERRIDES if not o.startswith("data.reward_")), *agent]
    one, pod = str(tmp_path / "one"), str(tmp_path / "pod")
    procs = _launch(tmp_path, one, 1, cache=jax_cache, overrides=overrides)
    procs += _launch(tmp_path, pod, 2, cache=jax_cache, overrides=overrides)
    codes = _wait(procs, timeout=900)
    logs = [_log(tmp_path, one, 0), _log(tmp_path, pod, 0), _log(tmp_path, pod, 1)]
    assert codes == [0, 0, 0], "\n".join(log[-3000:] for log in logs)
    reference, rows = read_metrics(one), read_metrics(pod)
    assert [r["step"] for r in rows] == [r["step"] for r in reference] == [1, 2, 3]
    assert all(r["train/grad_norm"] > 1e-4 for r in reference)  # nothing compared is 0
    assert sum(r["agents/split_rollouts"] for r in reference) > 0
    _assert_same_metrics(rows, reference, steps=[1, 2, 3])
    counts = ("agents/calls", "agents/sequences", "agents/split_rollouts", "reward/num_masked")
    for r, ref in zip(rows, reference):
        assert {k: r[k] for k in counts} == {k: ref[k] for k in counts}, r["step"]
        assert r["agents/calls"] == 32 and r["agents/sampler_calls"] >= 4  # 2 a host at least
        assert r["agents/sampler_batch_max"] <= 8  # a host batches only its own rows
