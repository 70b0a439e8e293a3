"""An in-memory datapath: for the service's unit tests and machines without tc flower.

It keeps rules and counts nothing; it checks what a real datapath would refuse
(unknown port, a rule already at that port and priority).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from dpu_agent.errors import AlreadyExists, NotFound
from dpu_agent.network.backend import FlowBackend
from dpu_agent.network.model import InstalledRule, PortInfo, RuleCounters, port_kind

if TYPE_CHECKING:
    from collections.abc import Sequence

    from dpu_agent.network.model import FlowRule


class MemoryFlowBackend(FlowBackend):
    """Rules in a dict; ports given at construction."""

    def __init__(self, ports: Sequence[str] = ("p0", "pf0vf0", "pf0vf1", "pf0vf2")) -> None:
        self._ports = {
            name: PortInfo(
                name=name,
                kind=port_kind(name),
                up=True,
                mac=f"02:00:00:00:00:{index:02x}",
                mtu=1500,
            )
            for index, name in enumerate(ports)
        }
        self._rules: dict[tuple[str, int], FlowRule] = {}
        self._lock = threading.Lock()

    def ports(self) -> list[PortInfo]:
        """The configured ports."""
        return sorted(self._ports.values(), key=lambda p: p.name)

    def install(self, rule: FlowRule) -> None:
        """Keep the rule."""
        with self._lock:
            if rule.ingress_port not in self._ports:
                raise NotFound(f"port {rule.ingress_port!r} does not exist")
            key = (rule.ingress_port, rule.priority)
            if key in self._rules:
                raise AlreadyExists(
                    f"port {rule.ingress_port} already has a rule at priority {rule.priority}"
                )
            self._rules[key] = rule

    def remove(self, rule: FlowRule) -> None:
        """Forget the rule."""
        with self._lock:
            self._rules.pop((rule.ingress_port, rule.priority), None)

    def counters(self, rule: FlowRule) -> RuleCounters:
        """Zeros (nothing flows through memory)."""
        if (rule.ingress_port, rule.priority) not in self._rules:
            raise NotFound(f"rule {rule.rule_id} is not installed")
        return RuleCounters()

    def installed(self) -> list[InstalledRule]:
        """The kept rules."""
        with self._lock:
            return [InstalledRule(p, prio, r.rule_id) for (p, prio), r in self._rules.items()]
