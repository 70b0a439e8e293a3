"""What a caller may name in a flow rule: ports, priorities, VLAN ids and VNIs, uplinks.

Ports: its functions' representors and shared ports; priorities: `TENANT_MIN_PRIORITY`
and up; tags: those granted to its tenant; to an uplink: frames in one of its VLANs.

`check_rule_access` is the one check the network service makes of every rule a
caller creates or changes (CreateFlowRule, UpdateFlowRule, ApplyFlowRules), before
the flow table checks the rule itself: the ports, the priority, the tags, then what
the rule sends to an uplink. The admin role passes all but the first (any managed
port) unchecked.

Ports
-----

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
| any other managed port (a host netdev)          | yes (tags: below) | yes               |
| not a managed port                              | NOT_FOUND         | NOT_FOUND         |

(*) when the agent manages functions: such a port is nobody's yet, and a rule on it
would act on the traffic of whichever function gets it next. An agent without a
function backend does not know who owns a representor and treats it as any other
managed port.

NOT_FOUND always says "ports/{name} does not exist", so another tenant's port cannot
be told from a missing one. The admin role may name any managed port.

Priorities
----------

tc runs a port's rules in priority order (lower first), and the first that decides a
frame's fate (forward, drop) ends it. An admin's rule on a tenant's representor (a
rate limit, a drop, the VLAN push that puts the function in its segment) must come
before the tenant's own rules there, or a tenant's rule of a lower number takes the
frames first. So the lowest priorities are the admin role's:

| caller         | priority                                                     |
|----------------|--------------------------------------------------------------|
| the admin role | 1..65535                                                     |
| any other      | `TENANT_MIN_PRIORITY` (1000)..65535; 1..999 PERMISSION_DENIED |

PERMISSION_DENIED, not INVALID_ARGUMENT: the same rule is valid from an admin; what
is wrong is who asks, as for an uplink as ingress port. A priority outside 1..65535
is INVALID_ARGUMENT for anyone (`validate`). A constant, not a setting: clients (and
dpuctl's help) can then state the band for every agent.

In the kernel, consecutive rules with the same mask share one tc pref (`layout`), so
an admin's rule and a tenant's may share one. That cannot put the tenant's first:
prefs follow priorities (each run of rules takes a pref above the earlier runs'), and
in one pref every filter has the same mask and a key of its own, so at most one of
them matches a frame (a rule repeating an earlier key starts a new pref). The first
rule to match a frame is the lowest-numbered one, whoever owns it
(`tests/unit/test_flow_layout.py` checks this against a model of the kernel).

What the band does not order:

- rules in different datapaths. The eswitch holds only offloaded rules, so an
  admin's rule that is not in hardware (offload `software`, or one the driver
  refused) does not come before a tenant's rule that is. An admin rule meant to bind
  tenants must be in hardware where there is hardware (offload `hardware`, or `any`
  with in_hardware);
- an admin's rule at 1000 or above: it is ordered among the tenants' by its number;
- rules saved before the band: they keep their priorities; changing such a tenant
  rule (UpdateFlowRule, ApplyFlowRules) must move it to 1000 or above.

Tags
----

The uplinks carry every tenant's traffic, and a VLAN id or VXLAN VNI is what keeps
one tenant's frames out of another's segment there. So a tag is the operator's to
give: `[network] tenant_tags_file` grants each tenant VLAN ids and VNIs
(`dpu_agent.network.tags`; by default none). For a caller without the admin role:

| the rule                                   | needs                                       |
|--------------------------------------------|---------------------------------------------|
| pushes VLAN id V (`vlan_push`)             | V granted                                   |
| encapsulates in VNI N (`vxlan_encap`)      | N granted                                   |
| pops a tag (`vlan_pop`)                    | a match on a granted `vlan_id` (the tag)    |
| decapsulates (`vxlan_decap`)               | a match on a granted `vxlan_vni`            |
| matches a tag on its own representor       | nothing                                     |
| is on a host netdev (a shared ingress)     | a match on a tag; every tag matched granted |

Else PERMISSION_DENIED naming the tag (or the missing match). Why each row:

- push, encap: the frame enters that segment wherever it is sent next; an ungranted
  tag is another tenant's segment.
- pop, decap: removing a tag takes frames out of a segment. On its own representor
  the frames are the tenant's, but the tag may be the one the operator put its
  function in (the function's `vlan_id` is the admin's to set; on BlueField that tag
  is itself a rule on the representor), so the tag removed must be the tenant's to
  remove; requiring the match names it.
- matches on its own representor select among the tenant's own frames: harmless.
- a host netdev (any managed port that is not an uplink or a representor) is shared:
  any tenant may name it as ingress, and its traffic is everyone's. A rule there that
  matched no tag would take (forward, mirror, drop, pop) every tenant's frames, so it
  must be confined to the tenant's own segments. (A rule on an uplink is already the
  admin's alone.) Without a function backend no representor is known to be anyone's
  and tenants are not kept apart by port (*); representors then follow the
  own-representor rows.

To an uplink
------------

An uplink (`p0`, `p1`) is every tenant's, and what keeps their frames apart there is
the frame's 802.1Q VLAN. So a rule of a caller without the admin role that forwards
or mirrors to an uplink must put the frame in one of its tenant's VLANs on the way.
The rule knows the frame's outer VLAN from `match.vlan_id`, then from its actions in
order: `vlan_push` V makes it V, `vlan_pop` takes it away (what was under it is not
known). Each forward or mirror to an uplink is checked with the frame as it is at
that action (a mirror's copy leaves then; the actions after it do not change it):

| the frame's outer VLAN at the forward or mirror     | needs                            |
|-----------------------------------------------------|----------------------------------|
| V, pushed before it (`vlan_push`)                   | V granted (as for any push)      |
| V, matched (`match.vlan_id`) and not popped since   | V granted                        |
| not known (**)                                      | `untagged = true` for the tenant |

(**) the rule matches no VLAN id (the frame is untagged, or the function tagged it
itself), matches 0 (a priority tag: no VLAN), or popped the tag it knew.
`untagged` is the operator's, in the tags file (`dpu_agent.network.tags`; default
false). Else PERMISSION_DENIED naming the action and what is missing. A VLAN matched
but not granted is refused even with `untagged = true`: the rule names another
tenant's segment.

A VNI does not put a frame in a segment on an uplink. `vxlan_encap` sets tunnel
metadata that only a VXLAN port (a host netdev) turns into an outer header; a frame
forwarded from it straight to an uplink leaves as it is (tc-tunnel_key(8)). And a
frame that matched `match.vxlan_vni` (on a VXLAN port) is already the inner frame,
`vxlan_decap` or not. So encapsulating (or matching a VNI, or decapsulating) and then
forwarding to an uplink needs a granted VLAN on the frame too (or `untagged`).
Encapsulation proper forwards to the VXLAN port, which this check does not cover.

Frames a rule sends to a port other than an uplink (the tenant's own representors, a
host netdev such as a VXLAN port) are checked by the ports and tags alone. What the
admin's rules do with a function's frames (its `vlan_id`; on BlueField an admin's rule
on the representor) comes first: the priority band above.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final, Protocol

from dpu_agent.auth import ADMIN_ROLE
from dpu_agent.errors import NotFound, PermissionDenied
from dpu_agent.network.model import (
    Forward,
    Mirror,
    PortKind,
    VlanPop,
    VlanPush,
    VxlanDecap,
    VxlanEncap,
    port_kind,
)
from dpu_agent.network.validate import check_range

if TYPE_CHECKING:
    from collections.abc import Collection, Iterator, Mapping
    from contextlib import AbstractContextManager

    from dpu_agent.auth import Principal
    from dpu_agent.network.model import FlowRule
    from dpu_agent.network.tags import TagGrant, TenantTags

#: Priorities below this are the admin role's: a rule of a caller without it takes
#: this or a higher number, so an admin's rule at a lower one comes first on its port.
TENANT_MIN_PRIORITY: Final = 1000
_TAGS_FILE: Final = "[network] tenant_tags_file"


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


def check_rule_access(
    rule: FlowRule,
    principal: Principal,
    managed: Collection[str],
    owners: Mapping[str, str] | None,
    tags: TenantTags,
) -> None:
    """Raise NotFound or PermissionDenied unless `principal` may make the rule (module doc).

    Its ports, its priority, its tags, and what it sends to an uplink. `owners` as for
    `check_rule_ports`; `tags` are the tenants' grants.
    """
    check_rule_ports(rule, principal, managed, owners)
    check_rule_priority(rule, principal)
    check_rule_tags(rule, principal, tags)
    check_rule_uplinks(rule, principal, tags)


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


def check_rule_priority(rule: FlowRule, principal: Principal) -> None:
    """Raise PermissionDenied if `principal` is no admin and the priority is an admin's.

    InvalidArgument, for anyone, if it is not a priority at all (`validate`).
    """
    check_range(rule.priority, "priority")
    if principal.admin or rule.priority >= TENANT_MIN_PRIORITY:
        return
    raise PermissionDenied(
        f"priority {rule.priority}: 1..{TENANT_MIN_PRIORITY - 1} are the {ADMIN_ROLE} role's"
        f" (its rules there come before any tenant's on the port); use"
        f" {TENANT_MIN_PRIORITY}..65535"
    )


def check_rule_tags(rule: FlowRule, principal: Principal, tags: TenantTags) -> None:
    """Raise PermissionDenied unless every VLAN id and VNI `rule` uses is `principal`'s."""
    if principal.admin:
        return
    grant = tags.of(principal.tenant)
    for value, vlan, where in _tags_used(rule, principal.tenant):
        if value not in (grant.vlans if vlan else grant.vnis):
            raise PermissionDenied(
                f"{where}: {'VLAN' if vlan else 'VNI'} {value} is not granted to tenant"
                f" {principal.tenant!r} (the operator grants tags in [network] tenant_tags_file)"
            )


def _tags_used(rule: FlowRule, tenant: str) -> Iterator[tuple[int, bool, str]]:
    """(id, is it a VLAN id (else a VNI), where) of every tag the rule must be granted.

    PermissionDenied if a rule that must name a tag (on a host port, popping,
    decapsulating) names none.
    """
    match = rule.match
    if port_kind(rule.ingress_port) is PortKind.HOST:
        if match.vlan_id is None and match.vxlan_vni is None:
            raise PermissionDenied(
                f"a rule on host port {rule.ingress_port} acts on every tenant's traffic: it"
                f" must match a VLAN id or VNI granted to tenant {tenant!r} (match.vlan_id,"
                " match.vxlan_vni)"
            )
        if match.vlan_id is not None:
            yield match.vlan_id, True, "match.vlan_id"
        if match.vxlan_vni is not None:
            yield match.vxlan_vni, False, "match.vxlan_vni"
    for index, action in enumerate(rule.actions):
        where = f"actions[{index}]"
        if isinstance(action, VlanPush):
            yield action.vlan_id, True, f"{where}: vlan_push"
        elif isinstance(action, VxlanEncap):
            yield action.vni, False, f"{where}: vxlan_encap"
        elif isinstance(action, VlanPop | VxlanDecap):
            vlan = isinstance(action, VlanPop)
            name, field = ("vlan_pop", "vlan_id") if vlan else ("vxlan_decap", "vxlan_vni")
            removed = getattr(match, field)
            if removed is None:
                raise PermissionDenied(
                    f"{where}: {name} removes a tag: the rule must match it (match.{field}),"
                    f" and it must be granted to tenant {tenant!r}"
                )
            yield removed, vlan, f"{where}: {name}"


def check_rule_uplinks(rule: FlowRule, principal: Principal, tags: TenantTags) -> None:
    """Raise PermissionDenied unless every frame `rule` sends to an uplink is in a granted VLAN.

    Or the tenant may send untagged to the uplinks. Admins: anything.
    """
    if principal.admin:
        return
    grant = tags.of(principal.tenant)
    # the frame's VLAN tags the rule knows, outermost last (0 matched: a priority tag,
    # no VLAN); what lies under the first is not known
    known = [rule.match.vlan_id] if rule.match.vlan_id else []
    popped: list[str] = []  # the actions that popped a known tag, for the message
    for index, action in enumerate(rule.actions):
        where = f"actions[{index}]"
        if isinstance(action, VlanPush):
            known.append(action.vlan_id)
        elif isinstance(action, VlanPop):
            if known:
                popped.append(f"{where} popped VLAN {known.pop()}")
        elif isinstance(action, Forward | Mirror) and port_kind(action.port) is PortKind.UPLINK:
            vlan = known[-1] if known else None
            refusal = _refusal(rule, vlan, popped, principal.tenant, grant)
            if refusal is not None:
                verb = "forward" if isinstance(action, Forward) else "mirror"
                raise PermissionDenied(f"{where}: {verb} to uplink {action.port}: {refusal}")


def _refusal(
    rule: FlowRule, vlan: int | None, popped: list[str], tenant: str, grant: TagGrant
) -> str | None:
    """Why a frame in VLAN `vlan` (None: not known) may not go to an uplink; None if it may."""
    if vlan is not None:
        if vlan in grant.vlans:
            return None
        return (
            f"the frame is in VLAN {vlan} (match.vlan_id), which is not granted to tenant"
            f" {tenant!r}: it would enter another tenant's segment ({_TAGS_FILE})"
        )
    if grant.untagged:
        return None
    why = ", ".join(popped) if popped else "it matches no VLAN id and pushes none before it"
    if any(isinstance(a, VxlanEncap) for a in rule.actions) or rule.match.vxlan_vni is not None:
        why += "; a VNI does not tag a frame sent to an uplink: only a VXLAN port encapsulates"
    return (
        f"the frame is in no VLAN granted to tenant {tenant!r} ({why}): push one before"
        " it (vlan_push), or match one (match.vlan_id) and keep it; sending untagged to"
        f" the uplinks needs untagged = true for the tenant in {_TAGS_FILE}"
    )


def _missing(port: str) -> NotFound:
    return NotFound(f"ports/{port} does not exist")
