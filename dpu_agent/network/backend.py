"""The small interface a datapath implements for the network service.

Synchronous and thread-safe; the service calls it in a thread
(`dpu_agent.offload.in_thread`). Every
method raises domain errors only (`dpu_agent.errors`): NotFound for an unknown port,
InvalidArgument for something the datapath cannot express, FailedPrecondition when
the kernel refuses (with the kernel's reason), Unavailable when it cannot be reached.
"""

from __future__ import annotations

import abc
import contextlib
from typing import TYPE_CHECKING

from dpu_agent.errors import NotFound

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from dpu_agent.network.model import FlowRule, InstalledRule, PortInfo, RuleCounters


class FlowBackend(abc.ABC):
    """Ports and flow rules of one datapath."""

    @abc.abstractmethod
    def ports(self) -> list[PortInfo]:
        """The ports the agent manages, by name."""

    @abc.abstractmethod
    def install(self, rule: FlowRule) -> None:
        """Program a rule, all of it or nothing (a failure leaves the datapath unchanged)."""

    @abc.abstractmethod
    def remove(self, rule: FlowRule) -> None:
        """Remove a rule (no error if it is already gone)."""

    def apply(self, remove: Sequence[FlowRule], install: Sequence[FlowRule]) -> None:
        """Remove, then install, rules as one unit: all of it or nothing.

        This default does it one rule at a time and undoes what it did when a step
        fails; a datapath that can batch (tc) overrides it.
        """
        removed: list[FlowRule] = []
        installed: list[FlowRule] = []
        try:
            for rule in remove:
                self.remove(rule)
                removed.append(rule)
            for rule in install:
                self.install(rule)
                installed.append(rule)
        except BaseException:
            for rule in reversed(installed):
                self.remove(rule)
            for rule in reversed(removed):
                self.install(rule)
            raise

    @abc.abstractmethod
    def counters(self, rule: FlowRule) -> RuleCounters:
        """What the datapath counted for a rule; NotFound if it is not installed."""

    def counters_many(self, rules: Sequence[FlowRule]) -> dict[str, RuleCounters]:
        """The counters of many rules by id; rules not installed are left out.

        This default asks for each rule; tc reads each port's filters once.
        """
        found = {}
        for rule in rules:
            with contextlib.suppress(NotFound):
                found[rule.rule_id] = self.counters(rule)
        return found

    @abc.abstractmethod
    def installed(self) -> list[InstalledRule]:
        """Every rule in the datapath on managed ports, the agent's and others'."""

    def remember(self, rules: Iterable[FlowRule]) -> None:  # noqa: B027 - optional
        """Rules an earlier process of the agent installed, so `installed()` can name them."""

    def close(self) -> None:  # noqa: B027 - optional
        """Release the datapath connection."""
