"""What the endpoint keeps of a rollout: its calls and its training sequences (the split rule).

A `Rollout` records every call (`Call`: prompt ids, each `Choice`'s ids, logprobs, finish
reason) and builds its SEQUENCES as calls finish (`add`): a call whose prompt ids start with
all of a sequence's ids extends the longest such sequence (the ids between: mask 0; the
completion: mask 1 with its logprobs) while its ids after the first prompt fit `budget`; any
other call starts a new sequence (the agent rewrote its history). `Settings` are the run's
bounds for the rollouts opened together (jgrpo.rollout.endpoint). docs/agents.md."""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass
class Choice:
    """One sampled completion of a call."""

    ids: list[int]
    logprobs: list[float]
    finish_reason: str
    """stop (a stop token or string), length (max_tokens or the budget), tool_calls."""
    text: str
    message: Optional[dict] = None
    """Chat calls: the assistant message returned (content, tool_calls)."""


@dataclasses.dataclass
class Call:
    """One request of a rollout, as served."""

    index: int
    kind: str
    """chat or completion."""
    prompt_ids: list[int]
    messages: Optional[list[dict]] = None
    """Chat calls: the request's messages, normalised (`_normal_message`)."""
    tools_key: str = ""
    choices: list[Choice] = dataclasses.field(default_factory=list)
    budget_cut: bool = False


@dataclasses.dataclass
class Sequence:
    """One training sequence of a rollout: prompt (mask 0) ++ region (generated: mask 1)."""

    prompt: list[int]
    region: list[int] = dataclasses.field(default_factory=list)
    generated: list[bool] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    truncated: bool = False
    """Its last completion ended by length (max_tokens or the budget)."""

    @property
    def ids(self) -> list[int]:
        return self.prompt + self.region


@dataclasses.dataclass
class Rollout:
    """What the endpoint keeps of one rollout (`open` ... `close`)."""

    id: str
    row: int
    """Global row index (keys its draws)."""
    budget: int
    max_calls: int
    calls: list[Call] = dataclasses.field(default_factory=list)
    sequences: list[Sequence] = dataclasses.field(default_factory=list)
    issued: int = 0
    """Calls accepted so far (the next call's index)."""
    budget_cuts: int = 0
    bad_requests: int = 0
    in_flight: int = 0
    since: float = 0.0
    waited_s: float = 0.0

    def waited(self, now: float) -> float:
        """Seconds this rollout has had a request in the endpoint (queued or sampling)."""
        return self.waited_s + (now - self.since if self.in_flight else 0.0)

    def longest_prefix(self, ids: list[int]) -> Optional[Sequence]:
        """The sequence with the most ids that `ids` starts with (None: none)."""
        best = None
        for s in self.sequences:
            full = s.ids
            if len(full) <= len(ids) and ids[: len(full)] == full:
                if best is None or len(full) > len(best.ids):
                    best = s
        return best

    def budget_left(self, prompt_ids: list[int]) -> int:
        s = self.longest_prefix(prompt_ids)
        used = 0 if s is None else len(prompt_ids) - len(s.prompt)
        return self.budget - used

    def add(self, prompt_ids: list[int], choice: Choice) -> None:
        """Extend the longest sequence `prompt_ids` continues (if the region still fits), else
        start a new one."""
        s = self.longest_prefix(prompt_ids)
        if s is not None and len(prompt_ids) - len(s.prompt) + len(choice.ids) <= self.budget:
            gap = prompt_ids[len(s.ids) :]
            s.region += gap + choice.ids
            s.generated += [False] * len(gap) + [True] * len(choice.ids)
            s.logprobs += [0.0] * len(gap) + choice.logprobs
        else:
            s = Sequence(list(prompt_ids), list(choice.ids), [True] * len(choice.ids))
            s.logprobs = list(choice.logprobs)
            self.sequences.append(s)
        s.truncated = choice.finish_reason == "length"


@dataclasses.dataclass(frozen=True)
class Settings:
    """The run's bounds for the rollouts opened together (`Endpoint.open`)."""

    budget: int
    """N: a sequence's ids after its first prompt (rollout.max_new_tokens)."""
    max_calls: int
    """Calls per rollout (rollout.max_turns)."""
    temperature: float
    top_p: float
    """The default top_p of a request that gives none."""
