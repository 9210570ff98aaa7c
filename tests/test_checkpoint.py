"""jgrpo.checkpoint: exact round trips (sharded too), pruning, half-written steps, meta."""

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import xla_flags
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jgrpo.checkpoint import Checkpointer, complete_steps, is_complete_step, latest_complete_step
from jgrpo.config import Config, to_dict

REPO = Path(__file__).resolve().parents[1]


def make_state(seed: int = 0) -> dict:
    """nnx params after one adamw update (non-zero moments), an int step and a typed key."""
    model = nnx.Linear(16, 8, rngs=nnx.Rngs(seed))
    params = nnx.state(model, nnx.Param)
    tx = optax.adamw(1e-2)
    opt_state = tx.init(params)
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5), params)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return {
        "params": params,
        "opt_state": opt_state,
        "step": 7,
        "key": jax.random.key(seed + 100),
        "legacy_key": jax.random.PRNGKey(seed + 200),
    }


def abstract_of(state):
    """Restore target: arrays -> ShapeDtypeStruct with the same sharding; scalars kept."""
    return jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
            if isinstance(x, jax.Array)
            else x
        ),
        state,
    )


def assert_state_equal(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert type(g) is type(w) or (isinstance(g, jax.Array) and isinstance(w, jax.Array))
        if isinstance(w, jax.Array) and jax.dtypes.issubdtype(w.dtype, jax.dtypes.prng_key):
            assert g.dtype == w.dtype
            g, w = jax.random.key_data(g), jax.random.key_data(w)
        assert np.asarray(g).dtype == np.asarray(w).dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def shardings_for(state, mesh, matrix_spec, vector_spec):
    """Param-shaped leaves sharded by rank, scalars and keys replicated."""

    def one(x):
        if not isinstance(x, jax.Array):
            return None
        if x.ndim == 2 and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return NamedSharding(mesh, matrix_spec)
        if x.ndim == 1 and x.shape[0] == 8:
            return NamedSharding(mesh, vector_spec)
        return NamedSharding(mesh, P())

    return jax.tree.map(one, state)


def place(state, shardings):
    return jax.tree.map(lambda x, s: x if s is None else jax.device_put(x, s), state, shardings)


def test_round_trip_exact(tmp_path):
    state = make_state()
    meta = {"data": {"epoch": 1, "position": 123}, "metrics_step": 5}
    with Checkpointer(tmp_path / "ckpt", keep_last=2) as ckpt:
        ckpt.save(5, state, meta)
        assert ckpt.latest_step() == 5
        restored, restored_meta = ckpt.restore(5, abstract_of(state))
    assert_state_equal(restored, state)
    assert isinstance(restored["params"], nnx.State)
    assert isinstance(restored["opt_state"], tuple)
    assert type(restored["opt_state"][0]) is type(state["opt_state"][0])  # ScaleByAdamState
    assert restored["step"] == 7 and type(restored["step"]) is int
    assert restored_meta == meta
    # The restored key draws the same numbers as the saved one.
    np.testing.assert_array_equal(
        jax.random.uniform(restored["key"], (4,)), jax.random.uniform(state["key"], (4,))
    )


def test_round_trip_sharded_and_resharded(tmp_path):
    assert jax.device_count() == 8
    mesh = jax.make_mesh((4, 2), ("data", "fsdp"))
    state = make_state(seed=1)
    saved_shardings = shardings_for(state, mesh, P("data", "fsdp"), P("fsdp"))
    state = place(state, saved_shardings)
    assert len(state["params"]["kernel"].value.addressable_shards) == 8

    with Checkpointer(tmp_path / "ckpt", keep_last=1) as ckpt:
        ckpt.save(3, state, {"step": 3})
        restored, _ = ckpt.restore(3, abstract_of(state))
        assert_state_equal(restored, state)
        for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
            if isinstance(want, jax.Array):
                assert got.sharding == want.sharding

        # Restore onto another layout (a different mesh shape): values equal, target shardings.
        mesh2 = jax.make_mesh((2, 4), ("data", "fsdp"))
        target_shardings = shardings_for(state, mesh2, P("fsdp", None), P())
        target = jax.tree.map(
            lambda x, s: x if s is None else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            state,
            target_shardings,
        )
        resharded, _ = ckpt.restore(3, target)
    assert_state_equal(resharded, state)
    for got, want in zip(jax.tree.leaves(resharded), jax.tree.leaves(target_shardings)):
        if want is not None:
            assert got.sharding == want


def test_async_save_survives_donation(tmp_path):
    state = make_state(seed=2)
    expected = np.asarray(state["params"]["kernel"].value)
    bump = jax.jit(lambda p: jax.tree.map(lambda v: v + 1.0, p), donate_argnums=0)
    with Checkpointer(tmp_path / "ckpt", keep_last=2, async_save=True) as ckpt:
        ckpt.save(1, state, {})
        # The next step donates the params while the write may still be in flight.
        state = {**state, "params": bump(state["params"])}
        ckpt.wait()
        assert ckpt.latest_step() == 1
        restored, _ = ckpt.restore(1, abstract_of(state))
    np.testing.assert_array_equal(np.asarray(restored["params"]["kernel"].value), expected)
    assert not np.array_equal(np.asarray(state["params"]["kernel"].value), expected)


def test_keep_last_prunes_oldest(tmp_path):
    state = {"w": jnp.arange(4.0), "step": 0}
    directory = tmp_path / "ckpt"
    with Checkpointer(directory, keep_last=2) as ckpt:
        for step in range(1, 6):
            ckpt.save(step, {**state, "step": step}, {"step": step})
        assert ckpt.all_steps() == [4, 5]
    assert sorted(p.name for p in directory.iterdir() if p.name.isdigit()) == ["4", "5"]
    # A fresh Checkpointer on the same folder continues the pruning.
    with Checkpointer(directory, keep_last=2) as ckpt:
        ckpt.save(6, state, {})
        assert ckpt.all_steps() == [5, 6]
        restored, meta = ckpt.restore(5, {"w": jnp.zeros(4), "step": 0})
    assert restored["step"] == 5 and meta == {"step": 5}


def test_meta_round_trip(tmp_path):
    meta = {
        "config": to_dict(Config()),
        "data_stream": {"epoch": 2, "index": 17, "order_seed": 42},
        "metrics": {"last_step": 10, "best": 0.75, "none": None},
        "tags": ["a", "b"],
        "nested": {"empty": {}, "list": [1, 2.5, "x", None, True]},
    }
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(10, {"x": jnp.ones(2)}, meta)
        _, restored = ckpt.restore(None, {"x": jnp.zeros(2)})
    assert restored == meta
    with pytest.raises(TypeError, match="JSON"):
        Checkpointer(tmp_path / "other").save(1, {"x": jnp.ones(2)}, {"bad": object()})


def test_restore_rejects_mismatched_target(tmp_path):
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(1, {"a": jnp.ones(3), "b": (jnp.zeros(2), jnp.zeros(2))}, {})
        with pytest.raises(ValueError, match="target tree differs"):
            ckpt.restore(1, {"a": jnp.ones(3), "b": [jnp.zeros(2)]})
        with pytest.raises(ValueError, match=r"\['a'\]"):
            ckpt.restore(1, {"a": jnp.ones(4), "b": (jnp.zeros(2), jnp.zeros(2))})
        with pytest.raises(ValueError, match="float32"):
            ckpt.restore(1, {"a": jnp.ones(3, jnp.int32), "b": (jnp.zeros(2), jnp.zeros(2))})
        with pytest.raises(FileNotFoundError, match="missing or incomplete"):
            ckpt.restore(2, {"a": jnp.ones(3), "b": (jnp.zeros(2), jnp.zeros(2))})


_KILLED_SAVE = """
import os, signal, sys
import jax.numpy as jnp
import orbax.checkpoint._src.path.atomicity as atomicity
from jgrpo.checkpoint import Checkpointer

directory, kill_at = sys.argv[1], sys.argv[2]
ckpt = Checkpointer(directory, keep_last=3)
ckpt.save(1, {"w": jnp.full((256, 256), 1.0), "step": 1}, {"step": 1})
finalize = atomicity.AtomicRenameTemporaryPath.finalize

async def killing_finalize(self):
    # kill_at=item: before the first item folder of step 2 is committed;
    # kill_at=step: every item written, just before the step folder is renamed.
    if kill_at == "item" or self.get_final().name == "2":
        os.kill(os.getpid(), signal.SIGKILL)
    return await finalize(self)

atomicity.AtomicRenameTemporaryPath.finalize = killing_finalize
ckpt.save(2, {"w": jnp.full((256, 256), 2.0), "step": 2}, {"step": 2})
print("save 2 finished: the kill did not happen")
"""


@pytest.mark.parametrize("kill_at", ["item", "step"])
def test_killed_save_is_ignored(tmp_path, kill_at):
    directory = tmp_path / "ckpt"
    script = tmp_path / "killed_save.py"
    script.write_text(textwrap.dedent(_KILLED_SAVE))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(None)}
    proc = subprocess.run(
        [sys.executable, str(script), str(directory), kill_at],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    leftovers = [p.name for p in directory.iterdir() if not is_complete_step(p)]
    # orbax 0.12 leaves <step>.orbax-checkpoint-tmp (maybe with a suffix in other versions).
    assert any(re.match(r"^2\.orbax-checkpoint-tmp", name) for name in leftovers), leftovers
    assert complete_steps(directory) == [1]
    assert latest_complete_step(directory) == 1

    with Checkpointer(directory, keep_last=3) as ckpt:
        assert ckpt.latest_step() == 1
        restored, meta = ckpt.restore(ckpt.latest_step(), {"w": jnp.zeros((256, 256)), "step": 0})
        assert meta == {"step": 1} and restored["step"] == 1
        np.testing.assert_array_equal(np.asarray(restored["w"]), np.ones((256, 256)))
        # The resumed run can write step 2 again.
        ckpt.save(2, {"w": jnp.full((256, 256), 2.0), "step": 2}, {"step": 2})
        assert ckpt.all_steps() == [1, 2]
    assert not any("tmp" in p.name for p in directory.iterdir())


def test_step_folder_without_commit_marker_is_ignored(tmp_path):
    """A step copied half-way (non-atomic sync, manual copy) has no commit markers."""
    directory = tmp_path / "ckpt"
    with Checkpointer(directory, keep_last=5) as ckpt:
        ckpt.save(1, {"w": jnp.ones(3)}, {"step": 1})
    shutil.copytree(directory / "1", directory / "2")
    (directory / "2" / "commit_success.txt").unlink()
    shutil.copytree(directory / "1", directory / "3")
    (directory / "3" / "state" / "commit_success.txt").unlink()
    (directory / "4.orbax-checkpoint-tmp").mkdir()
    (directory / "notes").mkdir()
    assert not is_complete_step(directory / "2")
    assert not is_complete_step(directory / "3")
    assert complete_steps(directory) == [1]
    assert latest_complete_step(tmp_path / "does-not-exist") is None
    with Checkpointer(directory, keep_last=5) as ckpt:
        assert ckpt.latest_step() == 1
        with pytest.raises(FileNotFoundError):
            ckpt.restore(3, {"w": jnp.ones(3)})


def test_no_orbax_thread_outlives_the_constructor(tmp_path):
    """orbax removes a killed run's tmp folders on a thread of its own: a process that built a
    Checkpointer and exited at once (a resume with no intact step, exit 2) used to race that
    thread and print its RuntimeError ("cannot schedule new futures after shutdown")."""
    import threading

    from orbax.checkpoint._src.futures.future import _SignalingThread  # orbax's commit threads

    directory = tmp_path / "ckpt"
    (directory / "4.orbax-checkpoint-tmp" / "state").mkdir(parents=True)
    before = set(threading.enumerate())
    ckpt = Checkpointer(directory, keep_last=3)
    new = [t for t in threading.enumerate() if t not in before]
    running = [t.name for t in new if isinstance(t, _SignalingThread) and t.is_alive()]
    assert running == [] and not (directory / "4.orbax-checkpoint-tmp").exists(), running
    assert ckpt._manager._cleanup_tmp_directory_future is None  # orbax's handle on it: joined
    ckpt.close()


def _flip_a_byte(step_dir: Path) -> None:
    """Flip one byte in the middle of the largest array data file of the step."""
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file()]
    target = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))


def _delete_a_data_file(step_dir: Path) -> None:
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file()]
    max(files, key=lambda p: p.stat().st_size).unlink()


DAMAGES = {
    "flipped-byte": _flip_a_byte,
    "half-deleted": _delete_a_data_file,
    "meta": lambda d: (d / "meta" / "metadata").write_text("{garbage"),
    "step-metadata": lambda d: (d / "_CHECKPOINT_METADATA").write_bytes(b"\x00\x01"),
    "commit-marker": lambda d: (d / "commit_success.txt").unlink(),
    "checksums": lambda d: (d / "jgrpo_checksums.json").write_text("[1, 2"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_damaged_newest_falls_back_and_is_replaced(tmp_path, damage):
    directory = tmp_path / "ckpt"
    states = {s: {"w": jnp.full((64, 64), float(s)), "step": s} for s in (1, 2, 3)}
    target = {"w": jnp.zeros((64, 64)), "step": 0}
    with Checkpointer(directory, keep_last=5) as ckpt:
        for s, state in states.items():
            ckpt.save(s, state, {"step": s})
        assert all(ckpt.verify(s) is None for s in (1, 2, 3))
    DAMAGES[damage](directory / "3")
    with Checkpointer(directory, keep_last=5) as ckpt:
        assert ckpt.verify(3) is not None
        with pytest.warns(UserWarning, match=r"resuming from step 2 \(step 3: "):
            restored, meta, step = ckpt.restore_latest_intact(target)
        assert step == 2 and meta == {"step": 2} and restored["step"] == 2
        np.testing.assert_array_equal(np.asarray(restored["w"]), np.full((64, 64), 2.0))
        # the resumed run saves step 3 again: the damaged one is replaced, not an error
        ckpt.save(3, {"w": jnp.full((64, 64), 3.5), "step": 3}, {"step": 3})
        assert ckpt.all_steps() == [1, 2, 3] and ckpt.verify(3) is None
        restored, _, step = ckpt.restore_latest_intact(target)
        assert step == 3
        np.testing.assert_array_equal(np.asarray(restored["w"]), np.full((64, 64), 3.5))
        with pytest.raises(ValueError, match="already exists"):  # an intact step is kept
            ckpt.save(3, states[3], {"step": 3})
    assert not [p.name for p in directory.iterdir() if p.name.startswith(".")]


def test_no_intact_checkpoint_is_a_one_line_error(tmp_path):
    from jgrpo.checkpoint import CheckpointError

    directory = tmp_path / "ckpt"
    target = {"w": jnp.zeros(8)}
    with Checkpointer(directory, keep_last=5) as ckpt:
        assert ckpt.restore_latest_intact(target) is None  # no checkpoint at all: a fresh start
        ckpt.save(1, {"w": jnp.ones(8)}, {})
        ckpt.save(2, {"w": jnp.ones(8)}, {})
    _flip_a_byte(directory / "1")
    _delete_a_data_file(directory / "2")
    with Checkpointer(directory, keep_last=5) as ckpt:
        with pytest.raises(CheckpointError, match=r"no intact checkpoint.*step 2: .*step 1: ") as e:
            ckpt.restore_latest_intact(target)
        assert "\n" not in str(e.value)


def test_async_save_writes_checksums(tmp_path):
    with Checkpointer(tmp_path / "ckpt", keep_last=2, async_save=True) as ckpt:
        ckpt.save(1, {"w": jnp.ones(8)}, {})
        ckpt.save(2, {"w": jnp.ones(8)}, {})
        ckpt.wait()
        assert (tmp_path / "ckpt" / "1" / "jgrpo_checksums.json").is_file()
        assert all(ckpt.verify(s) is None for s in (1, 2))
    _flip_a_byte(tmp_path / "ckpt" / "2")
    with Checkpointer(tmp_path / "ckpt", keep_last=2) as ckpt:
        assert "checksum" in ckpt.verify(2)
