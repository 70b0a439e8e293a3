"""NetworkService: ports and flow rules (a thin gRPC layer over the flow table).

Ports are agent-wide: listing them needs the admin role. Which ports a rule may name
(its ingress port, and the targets of its forwards and mirrors) depends on who calls
(`dpu_agent.network.access`): a function's representor only by the function's tenant,
an uplink as ingress only by an admin; another tenant's port answers NOT_FOUND exactly
as a missing one does. Priorities 1..999 are the admins' (a tenant's rule takes 1000
and up, after theirs on the port). The VLAN ids and VNIs a rule pushes, pops and
matches must be granted to the caller's tenant (`[network] tenant_tags_file`; admins
need none), and what it forwards or mirrors to an uplink must be in a granted VLAN
(or the tenant granted untagged traffic); else PERMISSION_DENIED. A flow rule belongs
to the tenant that created it (kept in the rule store); another tenant's rule answers
NOT_FOUND exactly as a missing one does, and admins see all. `[quota] max_flow_rules`
bounds the rules of a tenant.
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
from typing import TYPE_CHECKING, Any, Final

from dpu_agent import auth, paging
from dpu_agent.errors import InvalidArgument, NotFound, ResourceExhausted
from dpu_agent.fair_lock import FairLock
from dpu_agent.network import model
from dpu_agent.network.access import check_rule_access
from dpu_agent.network.table import Applied, Changes
from dpu_agent.network.tags import TenantTags
from dpu_agent.offload import in_thread
from dpu_agent.quota import Quotas
from dpu_agent.services.convert import resource_id, timestamp
from dpu_wire import names
from dpu_wire.v1 import network_pb2, network_pb2_grpc

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Mapping

    import grpc

    from dpu_agent.auth import Principal
    from dpu_agent.network.access import PortOwners
    from dpu_agent.network.table import FlowTable

MIN_INTERVAL_MS: Final = 100
MS_PER_WATCHED_RULE: Final = 1  # a watch of n rules updates at most every n ms
MAX_WATCHED_NAMES: Final = 1000  # rules named in one watch request
MAX_WATCHED_RULES: Final = 10_000  # rules a watch of all the caller's rules covers
MAX_WATCHES_PER_TENANT: Final = 16  # concurrent WatchFlowCounters streams
_KINDS: Final = {
    model.PortKind.UPLINK: network_pb2.PORT_KIND_UPLINK,
    model.PortKind.REPRESENTOR: network_pb2.PORT_KIND_REPRESENTOR,
    model.PortKind.HOST: network_pb2.PORT_KIND_HOST,
}
_OFFLOAD_IN: Final = {
    network_pb2.OFFLOAD_POLICY_UNSPECIFIED: model.OffloadPolicy.ANY,
    network_pb2.OFFLOAD_POLICY_ANY: model.OffloadPolicy.ANY,
    network_pb2.OFFLOAD_POLICY_HARDWARE_ONLY: model.OffloadPolicy.HARDWARE_ONLY,
    network_pb2.OFFLOAD_POLICY_SOFTWARE_ONLY: model.OffloadPolicy.SOFTWARE_ONLY,
}
_OFFLOAD_OUT: Final = {
    model.OffloadPolicy.ANY: network_pb2.OFFLOAD_POLICY_ANY,
    model.OffloadPolicy.HARDWARE_ONLY: network_pb2.OFFLOAD_POLICY_HARDWARE_ONLY,
    model.OffloadPolicy.SOFTWARE_ONLY: network_pb2.OFFLOAD_POLICY_SOFTWARE_ONLY,
}
_UPDATABLE: Final = {"priority", "match", "actions", "offload"}


def port_name(name: str, what: str) -> str:
    """The netdev in "ports/{name}"."""
    return resource_id(name, "ports", what)


def _network(text: str, what: str) -> model.IPNetwork | None:
    if not text:
        return None
    try:
        return ipaddress.ip_network(text)
    except ValueError as exc:
        raise InvalidArgument(f"{what}: {exc}") from None


def _address(text: str, what: str) -> model.IPAddress:
    try:
        return ipaddress.ip_address(text)
    except ValueError as exc:
        raise InvalidArgument(f"{what}: {exc}") from None


def match_from(m: network_pb2.FlowMatch) -> model.FlowMatch:
    """The domain match of a proto match."""
    return model.FlowMatch(
        ethertype=m.ethertype if m.HasField("ethertype") else None,
        src_mac=m.src_mac.lower() or None,
        dst_mac=m.dst_mac.lower() or None,
        vlan_id=m.vlan_id if m.HasField("vlan_id") else None,
        ip_protocol=m.ip_protocol if m.HasField("ip_protocol") else None,
        src_ip=_network(m.src_ip_prefix, "match.src_ip_prefix"),
        dst_ip=_network(m.dst_ip_prefix, "match.dst_ip_prefix"),
        src_port=m.src_l4_port if m.HasField("src_l4_port") else None,
        dst_port=m.dst_l4_port if m.HasField("dst_l4_port") else None,
        vxlan_vni=m.vxlan_vni if m.HasField("vxlan_vni") else None,
    )


def action_from(a: network_pb2.FlowAction, where: str) -> model.Action:  # noqa: PLR0911
    """The domain action of a proto action."""
    kind = a.WhichOneof("action")
    if kind == "forward":
        return model.Forward(port_name(a.forward.port, f"{where}.forward.port"))
    if kind == "mirror":
        return model.Mirror(port_name(a.mirror.port, f"{where}.mirror.port"))
    if kind == "drop":
        return model.Drop()
    if kind == "police":
        return model.Police(a.police.rate_bps, a.police.burst_bytes)
    if kind == "vlan_push":
        return model.VlanPush(a.vlan_push.vlan_id, a.vlan_push.priority)
    if kind == "vlan_pop":
        return model.VlanPop()
    if kind == "vxlan_encap":
        e = a.vxlan_encap
        return model.VxlanEncap(
            e.vni,
            _address(e.src_ip, f"{where}.vxlan_encap.src_ip"),
            _address(e.dst_ip, f"{where}.vxlan_encap.dst_ip"),
            e.dst_port or 4789,
        )
    if kind == "vxlan_decap":
        return model.VxlanDecap()
    if kind == "count":
        return model.Count()
    raise InvalidArgument(f"{where}: an action is required")


def rule_from(rule_id: str, r: network_pb2.FlowRule, tenant: str) -> model.FlowRule:
    """The domain rule of a proto rule, owned by `tenant`."""
    return model.FlowRule(
        rule_id=rule_id,
        priority=r.priority,
        ingress_port=port_name(r.ingress_port, "flow_rule.ingress_port"),
        match=match_from(r.match),
        actions=tuple(action_from(a, f"actions[{i}]") for i, a in enumerate(r.actions)),
        offload=_OFFLOAD_IN[r.offload],
        tenant=tenant,
    )


def _match_to(m: model.FlowMatch) -> network_pb2.FlowMatch:
    out = network_pb2.FlowMatch(
        src_mac=m.src_mac or "",
        dst_mac=m.dst_mac or "",
        src_ip_prefix=str(m.src_ip or ""),
        dst_ip_prefix=str(m.dst_ip or ""),
    )
    for field, value in (
        ("ethertype", m.ethertype),
        ("vlan_id", m.vlan_id),
        ("ip_protocol", m.ip_protocol),
        ("src_l4_port", m.src_port),
        ("dst_l4_port", m.dst_port),
        ("vxlan_vni", m.vxlan_vni),
    ):
        if value is not None:
            setattr(out, field, value)
    return out


def _action_to(a: model.Action) -> network_pb2.FlowAction:  # noqa: PLR0911
    if isinstance(a, model.Forward):
        return network_pb2.FlowAction(forward=network_pb2.ForwardAction(port=f"ports/{a.port}"))
    if isinstance(a, model.Mirror):
        return network_pb2.FlowAction(mirror=network_pb2.MirrorAction(port=f"ports/{a.port}"))
    if isinstance(a, model.Drop):
        return network_pb2.FlowAction(drop=network_pb2.DropAction())
    if isinstance(a, model.Police):
        police = network_pb2.PoliceAction(rate_bps=a.rate_bps, burst_bytes=a.burst_bytes)
        return network_pb2.FlowAction(police=police)
    if isinstance(a, model.VlanPush):
        push = network_pb2.VlanPushAction(vlan_id=a.vlan_id, priority=a.priority)
        return network_pb2.FlowAction(vlan_push=push)
    if isinstance(a, model.VlanPop):
        return network_pb2.FlowAction(vlan_pop=network_pb2.VlanPopAction())
    if isinstance(a, model.VxlanEncap):
        encap = network_pb2.VxlanEncapAction(
            vni=a.vni, src_ip=str(a.src_ip), dst_ip=str(a.dst_ip), dst_port=a.dst_port
        )
        return network_pb2.FlowAction(vxlan_encap=encap)
    if isinstance(a, model.VxlanDecap):
        return network_pb2.FlowAction(vxlan_decap=network_pb2.VxlanDecapAction())
    return network_pb2.FlowAction(count=network_pb2.CountAction())


def counters_to(c: model.RuleCounters) -> network_pb2.FlowCounters:
    """The proto counters."""
    return network_pb2.FlowCounters(
        packets=c.packets, bytes=c.bytes, last_used=timestamp(c.last_used_ns)
    )


def rule_to(r: model.FlowRule, counters: model.RuleCounters | None = None) -> network_pb2.FlowRule:
    """The proto rule (with counters when given)."""
    out = network_pb2.FlowRule(
        name=f"flowRules/{r.rule_id}",
        priority=r.priority,
        ingress_port=f"ports/{r.ingress_port}",
        match=_match_to(r.match),
        actions=[_action_to(a) for a in r.actions],
        offload=_OFFLOAD_OUT[r.offload],
        tenant=r.tenant,
    )
    if counters is not None:
        out.counters.CopyFrom(counters_to(counters))
        out.in_hardware = counters.in_hardware
    return out


def port_to(p: model.PortInfo, function: str = "") -> network_pb2.Port:
    """The proto port (of function id `function`, for a function's representor)."""
    c = p.counters
    return network_pb2.Port(
        name=f"ports/{p.name}",
        kind=_KINDS[p.kind],
        oper_state=network_pb2.OPER_STATE_UP if p.up else network_pb2.OPER_STATE_DOWN,
        mac_address=p.mac,
        mtu=p.mtu,
        counters=network_pb2.PortCounters(
            rx_packets=c.rx_packets,
            tx_packets=c.tx_packets,
            rx_bytes=c.rx_bytes,
            tx_bytes=c.tx_bytes,
            rx_dropped=c.rx_dropped,
            tx_dropped=c.tx_dropped,
        ),
        function=f"functions/{function}" if function else "",
    )


class NetworkService(network_pb2_grpc.NetworkServiceServicer):
    """Ports and flow rules; the table does the work in a thread.

    Every call of the table runs in a thread, reads too: the table holds its lock while
    the datapath is programmed and the rule file is written and synced, and a read on
    the event loop stopped every call of every tenant for that long.
    """

    def __init__(
        self,
        table: FlowTable,
        quotas: Quotas | None = None,
        owners: PortOwners | None = None,
        tags: TenantTags | None = None,
    ) -> None:
        self._table = table
        self._quotas = quotas or Quotas()
        self._owners = owners  # None: the agent manages no functions
        self._tags = tags or TenantTags()  # none given: no tenant may use a tag
        self._creating = FairLock()  # the quota check and the create hold together
        self._watches: collections.Counter[str] = collections.Counter()  # tenant -> streams

    def _checked(
        self, rule: model.FlowRule, principal: Principal, *, replace: bool
    ) -> model.FlowRule:
        """Create (or replace) the rule if the caller may name its ports and tags. In a thread.

        Port ownership is held still from the check until the rule is in the table, so
        a function cannot be deleted (and its port change hands) in between.
        """
        if self._owners is None:
            return self._apply(rule, principal, None, replace=replace)
        with self._owners.port_owners() as owners:
            return self._apply(rule, principal, owners, replace=replace)

    def _apply(
        self,
        rule: model.FlowRule,
        principal: Principal,
        owners: Mapping[str, str] | None,
        *,
        replace: bool,
    ) -> model.FlowRule:
        managed = {p.name for p in self._table.ports()}
        check_rule_access(rule, principal, managed, owners, self._tags)
        return self._table.update(rule) if replace else self._table.create(rule)

    async def _owned(self, rule_id: str) -> model.FlowRule:
        """The rule, if the caller may see it; NotFound as for a missing one otherwise."""
        rule = await in_thread(self._table.get, rule_id)
        auth.check_owner(rule.tenant, f"flowRules/{rule_id}")  # the table's not-found text
        return rule

    def _ports(self) -> tuple[list[model.PortInfo], Mapping[str, str]]:
        """The managed ports, and representor port -> function id. In a thread."""
        functions = self._owners.port_functions() if self._owners is not None else {}
        return self._table.ports(), functions

    async def ListPorts(
        self, request: network_pb2.ListPortsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> network_pb2.ListPortsResponse:
        """Every managed port (one page: a DPU has few). Admin role."""
        auth.require_admin("listing the ports")
        ports, functions = await in_thread(self._ports)
        return network_pb2.ListPortsResponse(
            ports=[port_to(p, functions.get(p.name, "")) for p in ports]
        )

    async def GetPort(
        self, request: network_pb2.GetPortRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> network_pb2.Port:
        """One port. Admin role; NotFound if the agent does not manage it."""
        auth.require_admin("reading a port")
        wanted = port_name(request.name, "name")
        ports, functions = await in_thread(self._ports)
        for port in ports:
            if port.name == wanted:
                return port_to(port, functions.get(port.name, ""))
        raise NotFound(f"ports/{wanted} does not exist")  # as a rule naming it is answered

    async def CreateFlowRule(
        self,
        request: network_pb2.CreateFlowRuleRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> network_pb2.FlowRule:
        """Validate, program and save a rule, owned by the caller's tenant."""
        principal = auth.current_principal()
        tenant = principal.tenant
        rule = rule_from(request.flow_rule_id, request.flow_rule, tenant)
        async with self._creating.hold():
            owned = sum(1 for r in await in_thread(self._table.rules) if r.tenant == tenant)
            self._quotas.check_flow_rules(tenant, owned + 1)
            created = await in_thread(self._checked, rule, principal, replace=False)
        return rule_to(created)

    async def GetFlowRule(
        self, request: network_pb2.GetFlowRuleRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> network_pb2.FlowRule:
        """One rule with its counters."""
        (rule_id,) = names.parse_name(request.name, "flowRules")
        rule = await self._owned(rule_id)
        counters = await in_thread(self._table.counters, rule_id, rule.tenant)
        return rule_to(rule, counters)

    async def ListFlowRules(
        self,
        request: network_pb2.ListFlowRulesRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> network_pb2.ListFlowRulesResponse:
        """The caller's rules (an admin's: all) (on one port) by id, a page at a time."""
        principal = auth.current_principal()
        port = port_name(request.ingress_port, "ingress_port") if request.ingress_port else None
        rules = [r for r in await in_thread(self._table.rules, port) if principal.can_see(r.tenant)]
        page, token = paging.page(rules, lambda r: r.rule_id, request)
        return network_pb2.ListFlowRulesResponse(
            flow_rules=[rule_to(r) for r in page], next_page_token=token
        )

    async def UpdateFlowRule(
        self,
        request: network_pb2.UpdateFlowRuleRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> network_pb2.FlowRule:
        """Change priority, match, actions or offload (the mask's paths; none: all four).

        The ingress port cannot change. Without a mask the request replaces the rule
        (AIP-134), so an ingress port other than the rule's is INVALID_ARGUMENT, as in
        ApplyFlowRules, rather than ignored; an empty one keeps the rule's.
        """
        (rule_id,) = names.parse_name(request.flow_rule.name, "flowRules")
        paths = set(request.update_mask.paths) or _UPDATABLE
        if paths - _UPDATABLE:
            bad = ", ".join(sorted(paths - _UPDATABLE))
            raise InvalidArgument(f"update_mask: cannot update {bad} (only {sorted(_UPDATABLE)})")
        old = await self._owned(rule_id)  # first: another tenant's rule is NOT_FOUND
        incoming = request.flow_rule
        if not request.update_mask.paths and incoming.ingress_port:
            port = port_name(incoming.ingress_port, "flow_rule.ingress_port")
            if port != old.ingress_port:
                raise InvalidArgument(
                    f"flow_rule: the ingress port of flowRules/{rule_id} cannot change"
                    " (delete it and create it)"
                )
        new = model.FlowRule(
            rule_id=rule_id,
            priority=incoming.priority if "priority" in paths else old.priority,
            ingress_port=old.ingress_port,
            match=match_from(incoming.match) if "match" in paths else old.match,
            actions=tuple(action_from(a, f"actions[{i}]") for i, a in enumerate(incoming.actions))
            if "actions" in paths
            else old.actions,
            offload=_OFFLOAD_IN[incoming.offload] if "offload" in paths else old.offload,
            tenant=old.tenant,  # the table refuses it if the id changed hands meanwhile
        )
        principal = auth.current_principal()
        return rule_to(await in_thread(self._checked, new, principal, replace=True))

    async def DeleteFlowRule(
        self,
        request: network_pb2.DeleteFlowRuleRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> network_pb2.DeleteFlowRuleResponse:
        """Remove a rule from the datapath."""
        (rule_id,) = names.parse_name(request.name, "flowRules")
        rule = await self._owned(rule_id)
        # the table checks the owner again: the id may have changed hands meanwhile
        await in_thread(self._table.delete, rule_id, rule.tenant)
        return network_pb2.DeleteFlowRuleResponse()

    async def ApplyFlowRules(
        self,
        request: network_pb2.ApplyFlowRulesRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> network_pb2.ApplyFlowRulesResponse:
        """Create, update and delete the caller's rules as one unit (all or none).

        Each list holds at most 1024 entries and the request 4096 items in all
        (`dpu_agent.validation`). Updates and deletes name the caller's rules
        (another tenant's answer NOT_FOUND), every port and tag is checked as for one rule,
        and the tenant's quota counts the rules after the whole change.
        """
        principal = auth.current_principal()
        tenant = principal.tenant
        creates = tuple(
            rule_from(resource_id(r.name, "flowRules", f"creates[{i}].name"), r, tenant)
            for i, r in enumerate(request.creates)
        )
        update_ids = [
            resource_id(r.name, "flowRules", f"updates[{i}].name")
            for i, r in enumerate(request.updates)
        ]
        deletes = tuple(
            resource_id(n, "flowRules", f"deletes[{i}]") for i, n in enumerate(request.deletes)
        )
        olds = await in_thread(self._owned_rules, [*update_ids, *deletes])
        updates = []
        for i, (rule_id, incoming) in enumerate(zip(update_ids, request.updates, strict=True)):
            old = olds[i]
            new = rule_from(rule_id, incoming, old.tenant)
            if new.ingress_port != old.ingress_port:
                raise InvalidArgument(
                    f"updates[{i}]: the ingress port of flowRules/{rule_id} cannot change"
                    " (delete it and create it)"
                )
            updates.append(new)
        changes = Changes(creates, tuple(updates), deletes)
        # the table checks these owners again (and an update's): an id may change hands
        owners = {r.rule_id: r.tenant for r in olds[len(update_ids) :]}
        async with self._creating.hold():
            owned = sum(1 for r in await in_thread(self._table.rules) if r.tenant == tenant)
            leaving = sum(1 for r in olds[len(update_ids) :] if r.tenant == tenant)
            if creates:
                self._quotas.check_flow_rules(tenant, owned + len(creates) - leaving)
            applied = await in_thread(
                self._apply_bulk, changes, owners, principal, request.validate_only
            )
        return network_pb2.ApplyFlowRulesResponse(
            created=[rule_to(r) for r in applied.created],
            updated=[rule_to(r) for r in applied.updated],
            deleted=[f"flowRules/{r.rule_id}" for r in applied.deleted],
        )

    def _owned_rules(self, rule_ids: list[str]) -> list[model.FlowRule]:
        """The rules, if the caller may see each (NotFound as for a missing one). In a thread."""
        rules = []
        for rule_id in rule_ids:
            rule = self._table.get(rule_id)
            auth.check_owner(rule.tenant, f"flowRules/{rule_id}")
            rules.append(rule)
        return rules

    def _apply_bulk(
        self,
        changes: Changes,
        rule_owners: Mapping[str, str],
        principal: Principal,
        validate_only: bool,  # noqa: FBT001
    ) -> Applied:
        """Check every port and tag the change names, then apply it, ownership held still.

        In a thread.

        `rule_owners` gives the tenant each deleted rule had when the caller was checked.
        """
        if self._owners is None:
            return self._apply_checked(changes, rule_owners, principal, None, validate_only)
        with self._owners.port_owners() as owners:
            return self._apply_checked(changes, rule_owners, principal, owners, validate_only)

    def _apply_checked(
        self,
        changes: Changes,
        rule_owners: Mapping[str, str],
        principal: Principal,
        owners: Mapping[str, str] | None,
        validate_only: bool,  # noqa: FBT001
    ) -> Applied:
        managed = {p.name for p in self._table.ports()}
        for rule in (*changes.create, *changes.update):
            check_rule_access(rule, principal, managed, owners, self._tags)
        return self._table.apply(changes, validate_only=validate_only, owners=rule_owners)

    async def WatchFlowCounters(
        self,
        request: network_pb2.WatchFlowCountersRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[network_pb2.FlowCounterUpdate]:
        """The selected rules' counters (default: the caller's) every interval, until it goes.

        A watch names at most `MAX_WATCHED_NAMES` rules, or covers the caller's first
        `MAX_WATCHED_RULES`. A tenant holds at most `MAX_WATCHES_PER_TENANT` watches;
        each round reads every counter in one read of the datapath (tc: one dump per
        port) in a worker thread, and rounds are at least
        `MIN_INTERVAL_MS` and `MS_PER_WATCHED_RULE` per rule apart, so watches cost the
        event loop a bounded number of updates a second.
        """
        if len(request.names) > MAX_WATCHED_NAMES:
            raise InvalidArgument(f"names: at most {MAX_WATCHED_NAMES} rules per watch")
        principal = auth.current_principal()
        wanted = [resource_id(n, "flowRules", f"names[{i}]") for i, n in enumerate(request.names)]
        for rule_id in wanted:
            await self._owned(rule_id)
        if self._watches[principal.tenant] >= MAX_WATCHES_PER_TENANT:
            raise ResourceExhausted(
                f"tenant {principal.tenant!r} already watches flow counters on "
                f"{MAX_WATCHES_PER_TENANT} streams"
            )
        self._watches[principal.tenant] += 1
        try:
            await context.send_initial_metadata(())
            while True:
                rules = await in_thread(self._table.rules)
                visible = [r.rule_id for r in rules if principal.can_see(r.tenant)]
                ids = wanted or visible[:MAX_WATCHED_RULES]
                counters = await in_thread(  # rules that changed hands are left out
                    self._table.counters_many, ids, None if principal.admin else principal.tenant
                )
                for rule_id in ids:
                    counted = counters.get(rule_id)
                    if counted is not None:  # deleted meanwhile
                        yield network_pb2.FlowCounterUpdate(
                            name=f"flowRules/{rule_id}", counters=counters_to(counted)
                        )
                interval_ms = max(
                    request.interval_ms or 1000, MIN_INTERVAL_MS, MS_PER_WATCHED_RULE * len(ids)
                )
                await asyncio.sleep(interval_ms / 1000)
        finally:
            self._watches[principal.tenant] -= 1
