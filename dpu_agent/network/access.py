"""Which ports a caller may name in a flow rule: its functions' representors, shared ports.

A function's representor port belongs to the function's tenant (the function manager
knows which port each function got). A rule that names a port, as its ingress port or
as the target of a forward or mirror, acts on that port's traffic, so for a caller
without the admin role:

| port                                            | ingress           | forward/mirror to |
|-------------------------------------------------|-------------------|-------------------|
| the representor of one of the caller's functions | yes               | yes               |
| the representor of another tenant's function    | NOT_FOUND         | NOT_FOUND         |
| a representor no function owns (*)              | NOT_FOUND         | NOT_FOUND         |
| an uplink (`p0`, `p1`: every tenant's traffic)  | PERMISSION_DENIED | yes               |
| any other managed port (a host netdev)          | yes               | yes               |
| not a managed port                              | NOT_FOUND         | NOT_FOUND         |

(*) when the agent manages functions: such a port is nobody's yet, and a rule on it
would act on the traffic of whichever function gets it next. An agent without a
function backend does not know who owns a representor and treats it as any other
managed port.

NOT_FOUND always says "ports/{name} does not exist", so another tenant's port cannot
be told from a missing one. The admin role may name any managed port.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from dpu_agent.auth import ADMIN_ROLE
from dpu_agent.errors import NotFound, PermissionDenied
from dpu_agent.network.model import Forward, Mirror, PortKind, port_kind

if TYPE_CHECKING:
    from collections.abc import Collection, Iterator, Mapping
    from contextlib import AbstractContextManager

    from dpu_agent.auth import Principal
    from dpu_agent.network.model import FlowRule


class PortOwners(Protocol):
    """Who owns which representor port (the function manager)."""

    def port_owners(self) -> AbstractContextManager[Mapping[str, str]]:
        """Hold ownership still while the context lasts; yield port -> tenant."""

    def port_functions(self) -> Mapping[str, str]:
        """Representor port -> the id of the function it represents."""


def named_ports(rule: FlowRule) -> Iterator[tuple[str, bool]]:
    """(port, is it the ingress port) for every port the rule names."""
    yield rule.ingress_port, True
    for action in rule.actions:
        if isinstance(action, Forward | Mirror):
            yield action.port, False


def check_rule_ports(
    rule: FlowRule,
    principal: Principal,
    managed: Collection[str],
    owners: Mapping[str, str] | None,
) -> None:
    """Raise NotFound or PermissionDenied unless `principal` may name every port of `rule`.

    `owners` maps representor ports to their function's tenant; None when the agent
    manages no functions.
    """
    for port, ingress in named_ports(rule):
        if port not in managed:
            raise _missing(port)
        if principal.admin:
            continue
        owner = owners.get(port) if owners is not None else None
        if owner is not None:
            if owner != principal.tenant:
                raise _missing(port)
            continue
        kind = port_kind(port)
        if kind is PortKind.REPRESENTOR and owners is not None:
            raise _missing(port)
        if kind is PortKind.UPLINK and ingress:
            raise PermissionDenied(f"a rule on uplink port {port} needs the {ADMIN_ROLE} role")


def _missing(port: str) -> NotFound:
    return NotFound(f"ports/{port} does not exist")
