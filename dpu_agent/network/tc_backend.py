"""Linux tc flower datapath: one flow rule is one flower filter on its port's ingress.

`TcFlowBackend` implements `FlowBackend` with the kernel's traffic control: on
BlueField in switchdev mode the filters are offloaded to the embedded switch, on any
other Linux (and in the test VM) the kernel runs them in software.

Layers (each its own module, the lower ones pure):

- `netlink`: ABI constants, message headers and the attribute codec (bytes only);
- `rtnl`: the NETLINK_ROUTE socket: requests, dumps, and batches with one
  acknowledgement round;
- `flower`: rule -> flower filter compiler and the filter parser (bytes only, unit
  tested without a kernel); it checks rules with `validate.check_rule`, the one
  validator the service uses too;
- this module: the backend, which resolves ports, keeps the hook, drives the socket.

Where a rule's filter goes
--------------------------

- hook: a `clsact` qdisc on `rule.ingress_port`, created when missing (an existing
  `clsact` or `ingress` qdisc is used as it is; the backend never deletes a qdisc);
- the filter: `tc filter add dev PORT ingress pref PRIORITY protocol PROTO flower ...`,
  chain 0, one per (port, priority): anything already at that priority is refused
  with AlreadyExists. `flower` documents the keys, actions and flags.

Which filters are ours: action cookies
--------------------------------------

The first action of every filter the backend installs carries a 16-byte tc action
cookie: `b"dpu1"` followed by the first 12 bytes of SHA-256(rule_id)
(`rule_cookie()`; `tc filter show` prints it as `cookie 64707531...`). The kernel
keeps it with the filter, so ours are recognised after an agent restart too:

- `remove()` and `counters()` look for the cookie of `rule.rule_id` at (port,
  priority), so they work for rules installed by an earlier process, and never
  touch a filter someone else put there;
- `installed()` reports `rule_id` for cookies of rules this object installed (or
  was told about with `remember()`), the string `"cookie:<32 hex digits>"` for
  other `dpu1` cookies (installed by an earlier process: match them against
  `rule_cookie(rule_id).hex()` of the persisted rules, or call `remember()` with
  those ids first), and None for filters without our cookie (made by hand, by
  other tools).

Bulk changes
------------

`apply(remove, install)` removes and installs many rules as one unit: every rule is
compiled and every port resolved first, each involved port's ingress is dumped once
to find the filters to delete and the priorities already taken, and then all the
deletes and adds go to the kernel as one `rtnl` batch (one acknowledgement round).
If the kernel refuses any of them, the ports are dumped again and the batch undone
(the adds that took deleted, the deleted filters added back), so the datapath is as
before, and the first refusal is raised.

`counters_many()` reads the counters of many rules with one filter dump per port
(the watch of 10,000 rules is one call), where `counters()` dumps one priority.

Kernel access
-------------

pyroute2 0.9.7 has no flower classifier, no tunnel_key action and no action
cookies, and its synchronous API gives every calling thread its own socket and
event loop (~0.45 ms per request). So `rtnl` speaks rtnetlink itself over one
socket with extended acks, guarded by one lock here: every method is thread-safe
and callable from `asyncio.to_thread`. pyroute2 provides what it has: entering a
named network namespace, decoding link messages (`ifinfmsg`: state, MAC, MTU,
nl.IFLA_STATS64) and tc's token-bucket arithmetic for the policer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fnmatch
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Final, Self

from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg

from dpu_agent.errors import (
    AlreadyExists,
    FailedPrecondition,
    NotFound,
    Unavailable,
)
from dpu_agent.network import netlink as nl
from dpu_agent.network.backend import FlowBackend
from dpu_agent.network.flower import (
    COOKIE_MAGIC,
    TCA_CLS_FLAGS_IN_HW,
    Filter,
    action_ports,
    compile_rule,
    delete_request,
    dump_request,
    parse_filter,
    rule_cookie,
)
from dpu_agent.network.model import (
    InstalledRule,
    OffloadPolicy,
    PortCounters,
    PortInfo,
    RuleCounters,
    port_kind,
)
from dpu_agent.network.rtnl import Rtnl
from dpu_agent.network.validate import check_rule

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator, Sequence
    from types import TracebackType

    from dpu_agent.network.flower import CompiledFilter
    from dpu_agent.network.model import FlowRule

__all__ = ["COOKIE_MAGIC", "COOKIE_PREFIX", "TcFlowBackend", "rule_cookie"]

COOKIE_PREFIX: Final = "cookie:"
_USER_HZ: Final = os.sysconf("SC_CLK_TCK")
_NEW_FILTER: Final = nl.NLM_F_REQUEST | nl.NLM_F_CREATE | nl.NLM_F_EXCL


class TcFlowBackend(FlowBackend):
    """Flow rules as tc flower filters on the ingress of managed netdevs.

    Args:
        ports: glob patterns (fnmatch, case-sensitive) of the netdev names the agent
            manages, e.g. ("p0", "p1", "pf*", "rep*"). Rules are installed on, and
            `ports()`/`installed()` report, only these; Forward and Mirror may name
            any netdev (e.g. a vxlan device).
        netns: a named network namespace (/run/netns/NAME) to work in; None = ours.
        default_offload: the policy for rules whose `offload` is ANY.

    See the module documentation for the mapping, cookies and limits.
    """

    def __init__(
        self,
        ports: Sequence[str],
        netns: str | None = None,
        default_offload: OffloadPolicy = OffloadPolicy.ANY,
    ) -> None:
        self._patterns = tuple(ports)
        self._default_offload = default_offload
        self._lock = threading.Lock()
        self._rule_ids: dict[bytes, str] = {}
        self._rtnl = Rtnl(netns)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @staticmethod
    def rule_cookie(rule_id: str) -> bytes:
        """The tc action cookie of `rule_id` (see the module documentation)."""
        return rule_cookie(rule_id)

    def remember(self, rule_ids: Iterable[str]) -> None:
        """Let `installed()` name filters of these rules (installed by an earlier process)."""
        with self._lock:
            self._rule_ids.update((rule_cookie(rule_id), rule_id) for rule_id in rule_ids)

    def managed(self, name: str) -> bool:
        """Whether a netdev name matches the managed patterns."""
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self._patterns)

    # The FlowBackend interface.
    def ports(self) -> list[PortInfo]:
        """Managed netdevs: state, MAC, MTU and 64-bit counters, by name."""
        with self._kernel("listing ports"):
            messages = self._rtnl.dump(
                nl.RTM_GETLINK, nl.IFINFOMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0)
            )
        found = []
        for message in messages:
            link = ifinfmsg(message)
            link.decode()
            name = link.get("ifname")
            if not isinstance(name, str) or not self.managed(name):
                continue
            stats = link.get("stats64") or {}
            lower_up = (
                link["flags"] & (nl.IFF_UP | nl.IFF_LOWER_UP)
            ) == nl.IFF_UP | nl.IFF_LOWER_UP
            state = link.get("operstate")
            found.append(
                PortInfo(
                    name=name,
                    kind=port_kind(name),
                    up=state == "UP" or (state == "UNKNOWN" and lower_up),
                    mac=str(link.get("address") or ""),
                    mtu=int(link.get("mtu") or 0),
                    counters=PortCounters(
                        **{
                            f.name: int(stats.get(f.name, 0))
                            for f in dataclasses.fields(PortCounters)
                        }
                    ),
                )
            )
        return sorted(found, key=lambda port: port.name)

    def install(self, rule: FlowRule) -> None:
        """Add the rule's flower filter; all of it or nothing.

        Raises:
            InvalidArgument: the rule cannot be expressed as one flower filter.
            NotFound: the ingress port is not managed or absent, or a Forward/Mirror
                port does not exist.
            AlreadyExists: a filter (ours or not) is at (ingress_port, priority).
            FailedPrecondition: the kernel refused the filter (its reason is in the
                message); no filter is left behind. A clsact qdisc created for the
                rule stays on the port.
            Unavailable: rtnetlink could not be reached.
        """
        check_rule(rule)
        with self._kernel(f"installing rule {rule.rule_id!r}"):
            ifindex = self._managed_ifindex(rule.ingress_port)
            targets = {name: self._target_ifindex(name) for name in action_ports(rule.actions)}
            compiled = compile_rule(rule, targets, self._default_offload, check=False)
            if self._filters(ifindex, rule.priority):
                raise AlreadyExists(
                    f"{rule.ingress_port} already has a filter at priority {rule.priority}"
                )
            cookie = rule_cookie(rule.rule_id)
            try:
                self._ensure_clsact(ifindex)
                self._rtnl.request(
                    nl.RTM_NEWTFILTER, _NEW_FILTER | nl.NLM_F_ACK, compiled.new_request(ifindex)
                )
            except nl.KernelError as exc:
                with contextlib.suppress(nl.KernelError):  # in case; normally there is none
                    self._delete_ours(ifindex, rule.priority, cookie)
                raise FailedPrecondition(
                    f"the kernel refused rule {rule.rule_id!r} on {rule.ingress_port}: {exc}"
                ) from exc
            self._rule_ids[cookie] = rule.rule_id

    def apply(self, remove: Sequence[FlowRule], install: Sequence[FlowRule]) -> None:
        """Remove and install rules as one unit, in one netlink batch (see the module doc).

        Raises as `install` does, before anything changes, for any rule of `install`
        (AlreadyExists also for two of them at one (port, priority)), and
        FailedPrecondition when the kernel refuses part of the batch: the batch is then
        undone (filters of `remove` it deleted come back, with fresh counters).
        """
        for rule in install:
            check_rule(rule)
        with self._kernel("applying a bulk change"):
            links = dict(self._links())
            compiled = [self._compile(rule, links) for rule in install]
            removing = [(self._removable(rule, links), rule) for rule in remove]
            ports = {ifindex for ifindex, _ in compiled}
            ports |= {ifindex for ifindex, _ in removing if ifindex is not None}
            before = {ifindex: self._filters(ifindex) for ifindex in ports}
            deletes = [
                (ifindex, f)
                for ifindex, rule in removing
                if ifindex is not None
                for f in before[ifindex]
                if f.pref == rule.priority and f.cookie == rule_cookie(rule.rule_id)
            ]
            self._check_free(install, compiled, before, deletes)
            for ifindex in {ifindex for ifindex, _ in compiled}:
                self._ensure_clsact(ifindex)
            requests = [
                (nl.RTM_DELTFILTER, nl.NLM_F_REQUEST, delete_request(ifindex, f))
                for ifindex, f in deletes
            ]
            requests += [
                (nl.RTM_NEWTFILTER, _NEW_FILTER, c.new_request(ifindex)) for ifindex, c in compiled
            ]
            try:
                refused = self._rtnl.batch(requests)
            except nl.KernelError as exc:  # answers lost: which took is unknown
                refused = {len(requests): exc}
            refused = {
                i: e
                for i, e in refused.items()
                if i >= len(deletes) or e.code not in (errno.ENOENT, errno.ENODEV)
            }
            if refused:
                index = min(refused)
                self._undo(ports, remove, install, deletes, links)
                what = (
                    f"rule {install[index - len(deletes)].rule_id!r}"
                    if len(deletes) <= index < len(requests)
                    else "the batch"
                )
                raise FailedPrecondition(
                    f"the kernel refused {what}: {refused[index]}; nothing was changed"
                )
            for rule in remove:
                self._rule_ids.pop(rule_cookie(rule.rule_id), None)
            self._rule_ids.update((rule_cookie(r.rule_id), r.rule_id) for r in install)

    def remove(self, rule: FlowRule) -> None:
        """Delete the rule's filter (found by its cookie); no error if it is gone.

        A filter at (ingress_port, priority) without the rule's cookie is left alone.
        NotFound only when ingress_port is not a managed port name.
        """
        if not self.managed(rule.ingress_port):
            raise NotFound(f"{rule.ingress_port!r} is not a managed port")
        cookie = rule_cookie(rule.rule_id)
        with self._kernel(f"removing rule {rule.rule_id!r}"):
            ifindex = self._ifindex(rule.ingress_port)
            if ifindex is not None and 1 <= rule.priority <= 0xFFFF:
                self._delete_ours(ifindex, rule.priority, cookie)
            self._rule_ids.pop(cookie, None)

    def counters(self, rule: FlowRule) -> RuleCounters:
        """Packets and bytes the rule's first action saw, when, and whether in hardware."""
        cookie = rule_cookie(rule.rule_id)
        with self._kernel(f"reading the counters of rule {rule.rule_id!r}"):
            ifindex = self._managed_ifindex(rule.ingress_port)
            found = [f for f in self._filters(ifindex, rule.priority) if f.cookie == cookie]
            now_ns = time.time_ns()
        if not found:
            raise NotFound(
                f"rule {rule.rule_id!r} is not installed on {rule.ingress_port}"
                f" at priority {rule.priority}"
            )
        return _counters(found[0], now_ns)

    def counters_many(self, rules: Sequence[FlowRule]) -> dict[str, RuleCounters]:
        """Counters of many rules by id, with one dump per port; not installed: left out."""
        by_port: dict[str, list[FlowRule]] = {}
        for rule in rules:
            by_port.setdefault(rule.ingress_port, []).append(rule)
        found = {}
        with self._kernel("reading counters"):
            links = dict(self._links())
            for port, group in by_port.items():
                if not self.managed(port) or port not in links:
                    continue
                filters = {(f.pref, f.cookie): f for f in self._filters(links[port])}
                now_ns = time.time_ns()
                for rule in group:
                    f = filters.get((rule.priority, rule_cookie(rule.rule_id)))
                    if f is not None:
                        found[rule.rule_id] = _counters(f, now_ns)
        return found

    def installed(self) -> list[InstalledRule]:
        """Every filter on the ingress of managed ports, any classifier, any chain.

        `rule_id` is the id for our cookies (the `"cookie:<hex>"` string for ones
        this object has not installed or been told about), None for other filters.
        """
        rules = []
        with self._kernel("listing filters"):
            for name, ifindex in self._links():
                if not self.managed(name):
                    continue
                rules += [
                    InstalledRule(ingress_port=name, priority=f.pref, rule_id=self._rule_id(f))
                    for f in self._filters(ifindex)
                ]
        return sorted(rules, key=lambda r: (r.ingress_port, r.priority, r.rule_id or ""))

    def close(self) -> None:
        """Close the rtnetlink socket."""
        with self._lock:
            self._rtnl.close()

    # Helpers below run with the lock held.
    @contextlib.contextmanager
    def _kernel(self, what: str) -> Iterator[None]:
        """Hold the lock; a kernel error not handled inside becomes a domain error."""
        with self._lock:
            try:
                yield
            except nl.KernelError as exc:
                if exc.code == errno.ENODEV:
                    raise NotFound(f"{what}: the port is gone ({exc})") from exc
                raise FailedPrecondition(f"{what}: the kernel refused: {exc}") from exc

    def _rule_id(self, f: Filter) -> str | None:
        if f.cookie is None or len(f.cookie) != 16 or not f.cookie.startswith(COOKIE_MAGIC):
            return None
        return self._rule_ids.get(f.cookie, COOKIE_PREFIX + f.cookie.hex())

    def _ifindex(self, name: str) -> int | None:
        if not name or len(name.encode()) >= nl.IFNAMSIZ or "/" in name:
            return None
        body = nl.IFINFOMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0)
        body += nl.string(nl.IFLA_IFNAME, name) + nl.u32(
            nl.IFLA_EXT_MASK, nl.RTEXT_FILTER_SKIP_STATS
        )
        try:
            answers = self._rtnl.request(nl.RTM_GETLINK, nl.NLM_F_REQUEST, body)
        except nl.KernelError as exc:
            if exc.code in (errno.ENODEV, errno.ENOENT, errno.EINVAL):
                return None
            raise Unavailable(f"cannot look up port {name!r}: {exc}") from exc
        if not answers:
            return None
        return int(nl.IFINFOMSG.unpack_from(answers[0], nl.NLMSGHDR.size)[2])

    def _managed_ifindex(self, name: str) -> int:
        if not self.managed(name):
            raise NotFound(f"{name!r} is not a managed port")
        ifindex = self._ifindex(name)
        if ifindex is None:
            raise NotFound(f"no port named {name!r}")
        return ifindex

    def _target_ifindex(self, name: str) -> int:
        ifindex = self._ifindex(name)
        if ifindex is None:
            raise NotFound(f"no port named {name!r} to forward or mirror to")
        return ifindex

    def _links(self) -> list[tuple[str, int]]:
        body = nl.IFINFOMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0)
        body += nl.u32(nl.IFLA_EXT_MASK, nl.RTEXT_FILTER_SKIP_STATS)
        links = []
        for message in self._rtnl.dump(nl.RTM_GETLINK, body):
            if nl.NLMSGHDR.unpack_from(message)[1] != nl.RTM_NEWLINK:
                continue
            ifindex = nl.IFINFOMSG.unpack_from(message, nl.NLMSGHDR.size)[2]
            name = nl.parse_attrs(message, nl.NLMSGHDR.size + nl.IFINFOMSG.size).get(nl.IFLA_IFNAME)
            if name:
                links.append((nl.asciiz(name), ifindex))
        return links

    def _filters(self, ifindex: int, pref: int = 0) -> list[Filter]:
        """Filters on the ingress hook (at one priority when pref > 0), any chain."""
        filters = (
            parse_filter(m) for m in self._rtnl.dump(nl.RTM_GETTFILTER, dump_request(ifindex, pref))
        )
        return [f for f in filters if f is not None]

    def _ensure_clsact(self, ifindex: int) -> None:
        body = nl.tcmsg(ifindex, nl.CLSACT_HANDLE, nl.TC_H_CLSACT, 0) + nl.string(
            nl.TCA_KIND, "clsact"
        )
        try:
            self._rtnl.request(
                nl.RTM_NEWQDISC,
                nl.NLM_F_REQUEST | nl.NLM_F_ACK | nl.NLM_F_CREATE | nl.NLM_F_EXCL,
                body,
            )
        except nl.KernelError as exc:
            if exc.code != errno.EEXIST:  # a clsact or ingress qdisc: use it
                raise

    def _delete_ours(self, ifindex: int, pref: int, cookie: bytes) -> None:
        for f in self._filters(ifindex, pref):
            if f.cookie != cookie:
                continue
            try:
                self._rtnl.request(
                    nl.RTM_DELTFILTER, nl.NLM_F_REQUEST | nl.NLM_F_ACK, delete_request(ifindex, f)
                )
            except nl.KernelError as exc:
                if exc.code not in (errno.ENOENT, errno.ENODEV):
                    raise

    def _compile(self, rule: FlowRule, links: dict[str, int]) -> tuple[int, CompiledFilter]:
        if not self.managed(rule.ingress_port):
            raise NotFound(f"{rule.ingress_port!r} is not a managed port")
        if rule.ingress_port not in links:
            raise NotFound(f"no port named {rule.ingress_port!r}")
        missing = [name for name in action_ports(rule.actions) if name not in links]
        if missing:
            raise NotFound(f"no port named {missing[0]!r} to forward or mirror to")
        compiled = compile_rule(rule, links, self._default_offload, check=False)
        return links[rule.ingress_port], compiled

    def _removable(self, rule: FlowRule, links: dict[str, int]) -> int | None:
        if not self.managed(rule.ingress_port):
            raise NotFound(f"{rule.ingress_port!r} is not a managed port")
        return links.get(rule.ingress_port)

    @staticmethod
    def _check_free(
        install: Sequence[FlowRule],
        compiled: Sequence[tuple[int, CompiledFilter]],
        before: dict[int, list[Filter]],
        deletes: Sequence[tuple[int, Filter]],
    ) -> None:
        """AlreadyExists if an install's (port, priority) is taken after the deletes."""
        deleted = set(deletes)
        taken = {
            (ifindex, f.pref)
            for ifindex, filters in before.items()
            for f in filters
            if (ifindex, f) not in deleted
        }
        for rule, (ifindex, c) in zip(install, compiled, strict=True):
            if (ifindex, c.pref) in taken:
                raise AlreadyExists(
                    f"{rule.ingress_port} already has a filter at priority {rule.priority}"
                )
            taken.add((ifindex, c.pref))

    def _undo(
        self,
        ports: Iterable[int],
        remove: Sequence[FlowRule],
        install: Sequence[FlowRule],
        deletes: Sequence[tuple[int, Filter]],
        links: dict[str, int],
    ) -> None:
        """Put the filters of a refused batch back as they were before it."""
        placed = {
            (links.get(r.ingress_port), r.priority, rule_cookie(r.rule_id))
            for r in (*remove, *install)
        }
        requests = [
            (nl.RTM_DELTFILTER, nl.NLM_F_REQUEST, delete_request(ifindex, f))
            for ifindex in ports
            for f in self._filters(ifindex)
            if (ifindex, f.pref, f.cookie) in placed
        ]
        restore = {(ifindex, f.pref) for ifindex, f in deletes}
        for rule in remove:
            ifindex = links.get(rule.ingress_port)
            if ifindex is not None and (ifindex, rule.priority) in restore:
                compiled = compile_rule(rule, links, self._default_offload, check=False)
                requests.append((nl.RTM_NEWTFILTER, _NEW_FILTER, compiled.new_request(ifindex)))
        refused = self._rtnl.batch(requests)
        if refused:
            raise Unavailable(
                f"a refused bulk change could not be undone ({refused[min(refused)]});"
                " the datapath may differ from the rules: restart the agent to reconcile"
            )


def _counters(f: Filter, now_ns: int) -> RuleCounters:
    """A dumped filter's counters; `now_ns` is the wall clock at the dump."""
    last_used_ns = 0
    if f.packets and f.lastuse is not None:
        last_used_ns = now_ns - f.lastuse * 1_000_000_000 // _USER_HZ
    return RuleCounters(
        packets=f.packets,
        bytes=f.bytes,
        last_used_ns=last_used_ns,
        in_hardware=bool(f.flags & TCA_CLS_FLAGS_IN_HW),
    )
