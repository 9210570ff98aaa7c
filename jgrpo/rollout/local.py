"""The in-process rollout backend: samples from the trainer's own parameter arrays.

No copy of the weights: `publish` stores a reference to the params the train step returned.
With LoRA those are the adapters; the frozen base given at construction completes them (a
shallow dict union: the two trees have disjoint top-level keys) for every generate call.
Generation is lazy: `request` records the examples, `collect` samples with the newest
published params, so it is always on-policy (rollout.max_staleness must be 0).
"""

from __future__ import annotations

from jgrpo.rollout.engine import VALIDATION_SALT, RolloutEngine, RolloutResult, step_key


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
        self.pending: dict[int, list] = {}

    def publish(self, params, version: int) -> dict[str, float]:
        self.params, self.version = params, version
        return {"rollout/weight_sync_s": 0.0}

    def request(self, step: int, examples: list) -> None:
        self.pending[step] = examples

    def collect(self, step: int) -> RolloutResult:
        examples = self.pending.pop(step)
        key = step_key(self.seed, step)
        return self.engine.rollout(
            self.graphdef, self._model_params(), examples, key, self.version, self.num_generations
        )

    def evaluate(self, examples: list, step: int, pass_k: int = 1) -> RolloutResult:
        key = step_key(self.seed, step, salt=VALIDATION_SALT)
        return self.engine.rollout(
            self.graphdef,
            self._model_params(),
            examples,
            key,
            self.version,
            pass_k,
            greedy=pass_k == 1,
        )

    def _model_params(self):
        return self.params if self.frozen is None else self.frozen | self.params

    def close(self) -> None:
        pass
