"""The in-process rollout backend: samples from the trainer's own parameter arrays.

No copy of the weights: `publish` stores a reference to the params the train step returned.
With LoRA those are the adapters; the frozen base given at construction completes them (a
shallow dict union: the two trees have disjoint top-level keys) for every generate call.
Generation is lazy: `request` records the examples, `collect` samples with the newest
published params, so it is always on-policy (rollout.max_staleness must be 0).

On a pod every process keeps its contiguous slice of the step's examples
(`distributed.process_slice`), draws with the global row index and global group ids, and
samples with its host's replica of the sharded params (`sharding.host_local`: no cross-host
traffic); its batch holds its rows only, left-padded to the widest host's width. Batch
statistics are computed over the gathered rows of all hosts, so every process reports the
one-process numbers."""

from __future__ import annotations

import jax
from flax import nnx

from jgrpo import distributed, sharding
from jgrpo.models.adapters import join_lora
from jgrpo.rollout.engine import VALIDATION_SALT, RolloutEngine, step_key, train_salt
from jgrpo.rollout.results import RolloutResult, gather_pod_rows, join_pod_slice
from jgrpo.tasks.child import report_failures


class LocalRollout:
    """Backend protocol: publish / request / collect / evaluate / close (see rollout/__init__)."""

    def __init__(
        self, engine: RolloutEngine, graphdef, seed: int, num_generations: int, frozen=None
    ):
        self.engine = engine
        self.frozen = frozen
        self.graphdef = graphdef
        self.seed = seed
        self.num_generations = num_generations
        self.params = None
        self.version = -1
        self.pending: dict[tuple[int, int], tuple[list, int]] = {}
        self._host_mesh = None

    def publish(self, params, version: int) -> dict[str, float]:
        if distributed.is_multiprocess():
            if self._host_mesh is None:
                self._host_mesh = sharding.host_mesh(jax.tree.leaves(params)[0].sharding.mesh)
            params = sharding.host_local(params, self._host_mesh)
        self.params, self.version = params, version
        return {"perf/weight_sync_s": 0.0}

    def request(self, step: int, examples: list, gen_batch: int = 0) -> None:
        lo, hi = distributed.process_slice(len(examples))
        self.pending[step, gen_batch] = (examples[lo:hi], lo)

    def collect(self, step: int, gen_batch: int = 0) -> RolloutResult:
        examples, first = self.pending.pop((step, gen_batch))
        key = step_key(self.seed, step, train_salt(gen_batch))
        result = self.engine.rollout(
            self.graphdef,
            self._model_params(),
            examples,
            key,
            self.version,
            self.num_generations,
            first_prompt=first,
        )
        report_failures(result.failures)  # user code is loud: once per name, in this process
        if not distributed.is_multiprocess():
            return result
        return join_pod_slice(result, group_offset=first)

    def evaluate(
        self, examples: list, step: int, pass_k: int = 1, val_set: str | None = None
    ) -> RolloutResult:
        """Validation generations (greedy when pass_k == 1) of `examples`, prompted and scored
        by the run's task or by the data.val_sets entry `val_set`."""
        key = step_key(self.seed, step, salt=VALIDATION_SALT)
        lo, hi = distributed.process_slice(len(examples))
        if not distributed.is_multiprocess():
            return self._evaluate(examples, key, pass_k, 0, val_set)
        names = tuple(self.engine.task_of(val_set).reward_names)
        result = self._evaluate(examples[lo:hi], key, pass_k, lo, val_set) if hi > lo else None
        return gather_pod_rows(result, names)  # None: fewer examples than hosts, none here

    def _evaluate(self, examples: list, key, pass_k: int, first: int, val_set) -> RolloutResult:
        result = self.engine.rollout(
            self.graphdef,
            self._model_params(),
            examples,
            key,
            self.version,
            pass_k,
            greedy=pass_k == 1,
            first_prompt=first,
            training=False,
            val_set=val_set,
        )
        report_failures(result.failures)
        return result

    def _model_params(self):
        return nnx.state(join_lora(self.graphdef, self.params, self.frozen))

    def close(self) -> None:
        pass
