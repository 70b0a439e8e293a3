"""Counts of the fuzz run, shared by the tests and the terminal summary."""

from __future__ import annotations

import collections
import dataclasses
import os
import random
import time
from typing import Final

import pytest
from hypothesis import HealthCheck, Phase, settings

MIN_CASES: Final = 10_000
"""Cases (RPC calls plus capsules) a full run of tests/fuzz must reach."""

settings.register_profile(
    "dpu-fuzz",
    database=None,  # each run starts from its seed; nothing replays from disk
    deadline=None,  # calls go to a live agent; a hang is checked per call instead
    derandomize=False,
    print_blob=True,
    phases=(Phase.explicit, Phase.generate, Phase.shrink),
    suppress_health_check=(
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ),
)
PROFILE: Final = settings.get_profile("dpu-fuzz")
LARGE_REPRS_OK: Final = pytest.mark.filterwarnings(
    "ignore:Generating overly large repr:hypothesis.errors.HypothesisWarning"
)
"""For fuzz test modules: a failing example can be a large message; Hypothesis warns
when it prints one, and under `filterwarnings = error` that warning would stand in
for the real failure."""


def _seed() -> int:
    text = os.environ.get("DPU_FUZZ_SEED", "")
    return int(text) if text.strip() else random.SystemRandom().getrandbits(32)


@dataclasses.dataclass
class FuzzStats:
    """What the run did: cases by kind, outcomes by target, failures found."""

    seed: int = dataclasses.field(default_factory=_seed)
    cases: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    outcomes: collections.Counter[tuple[str, str]] = dataclasses.field(
        default_factory=collections.Counter
    )
    notes: list[str] = dataclasses.field(default_factory=list)  # figures for the summary
    started: float = 0.0  # monotonic and process CPU time at the first case
    cpu_started: float = 0.0
    agent_cpu_s: float = 0.0

    @property
    def total(self) -> int:
        """Every case so far."""
        return sum(self.cases.values())

    def count(self, kind: str, target: str, outcome: str) -> None:
        """Record one case."""
        if not self.cases:
            self.started, self.cpu_started = time.monotonic(), time.process_time()
        self.cases[kind] += 1
        self.outcomes[target, outcome] += 1

    def missing(self, targets: set[str]) -> set[str]:
        """Targets (RPCs, capsule kinds) of the suite that got no case in this run."""
        return targets - {target for target, _ in self.outcomes}


STATS: Final = FuzzStats()
