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
- the filter: `tc filter add dev PORT ingress pref PREF protocol PROTO handle PRIORITY
  flower ...`, chain 0. Consecutive rules (by priority) with the same protocol, skip
  flags and mask share one pref (`layout` says which and why: a packet then pays one
  hash lookup per run of same-mask rules instead of one flower instance per rule).
  The handle is the rule's priority, so the dump says which filter is which rule. Two
  rules of ours at one (port, priority), or a rule at the pref of a filter that is not
  ours, are refused with AlreadyExists. `flower` documents the keys, actions and flags.
- a change moves as few filters as it can (none when rules are appended, prepended or
  removed); a rule of another mask inserted in the middle of a run moves the run's
  tail to a new pref, added there before it is deleted from the old one, so it never
  stops matching (its counters restart). The backend keeps each port's filters as it
  last read them; `install` rereads the prefs it adds to, `apply` and `installed()`
  read the ports anew.

Which filters are ours: action cookies
--------------------------------------

The first action of every filter the backend installs carries a 16-byte tc action
cookie: `b"dpu1"` followed by the first 12 bytes of SHA-256(rule_id)
(`rule_cookie()`; `tc filter show` prints it as `cookie 64707531...`). The kernel
keeps it with the filter, so ours are recognised after an agent restart too:

- `remove()` and `counters()` look for the cookie of `rule.rule_id` on the port, so
  they work for rules installed by an earlier process, and never touch a filter
  someone else put there;
- `installed()` reports `rule_id` for cookies of rules this object installed (or
  was told about with `remember()`), the string `"cookie:<32 hex digits>"` for
  other `dpu1` cookies (installed by an earlier process: match them against
  `rule_cookie(rule_id).hex()` of the persisted rules, or call `remember()` with
  those rules first, which also lets new rules join their prefs), and None for
  filters without our cookie (made by hand, by other tools).

Bulk changes
------------

`apply(remove, install)` removes and installs many rules as one unit: every rule is
compiled and every port resolved first, each involved port's ingress is dumped once,
the layout says where every rule of the port goes, and then all the deletes, moves
and adds go to the kernel as one `rtnl` batch (one acknowledgement round): deletes,
then adds to prefs nothing leaves, then the old places of moved filters, then the
other adds. If the kernel refuses any of it, the ports are dumped again and the
batch undone (what it added deleted, what it deleted or moved put back where it
was), so the datapath is as before, and the first refusal is raised.

`counters_many()` reads the counters of many rules with one filter dump per port
(the watch of 10,000 rules is one call), where `counters()` dumps one priority.

Kernel access
-------------

pyroute2 0.9.7 has no flower classifier, no tunnel_key action and no action
cookies, and its synchronous API gives every calling thread its own socket and
event loop (~0.45 ms per request). So `rtnl` speaks rtnetlink itself over one
socket with extended acks, guarded by one lock here: every method is thread-safe
and callable from a thread (`dpu_agent.offload.in_thread`). pyroute2 provides what
it has: entering a named network namespace, decoding link messages (`ifinfmsg`: state, MAC, MTU,
nl.IFLA_STATS64) and tc's token-bucket arithmetic for the policer.
"""

from __future__ import annotations

import bisect
import collections
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
    CompiledFilter,
    Filter,
    action_ports,
    compile_rule,
    delete_request,
    dump_request,
    flower_match,
    mask_group,
    parse_filter,
    rule_cookie,
    skip_flags,
)
from dpu_agent.network.layout import MAX_PREF, Slot, place
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
    from collections.abc import Callable, Iterable, Iterator, Sequence
    from types import TracebackType

    from dpu_agent.network.model import FlowRule

__all__ = ["COOKIE_MAGIC", "COOKIE_PREFIX", "TcFlowBackend", "rule_cookie"]

COOKIE_PREFIX: Final = "cookie:"
_USER_HZ: Final = os.sysconf("SC_CLK_TCK")
_NEW_FILTER: Final = nl.NLM_F_REQUEST | nl.NLM_F_CREATE | nl.NLM_F_EXCL
# Port names whose match against the patterns is remembered: names come from clients'
# rules, so the memory is bounded (names past it are matched every time).
MANAGED_NAMES_KEPT: Final = 4096


class TcFlowBackend(FlowBackend):
    """Flow rules as tc flower filters on the ingress of managed netdevs.

    Args:
        ports: glob patterns (fnmatch, case-sensitive) of the netdev names the agent
            manages, e.g. ("p0", "p1", "pf*", "rep*"). Rules are installed on, and
            `ports()`/`installed()` report, only these; Forward and Mirror may name
            any netdev (e.g. a vxlan device).
        netns: a named network namespace (/run/netns/NAME) to work in; None = ours.
        default_offload: the policy for rules whose `offload` is ANY.
        reread_after: seconds a port's filters, as last read, are trusted by `install`
            (a filter someone else adds is seen by installs this long after it at
            most); `apply` and `installed()` always read them anew.

    See the module documentation for the mapping, cookies and limits.
    """

    def __init__(
        self,
        ports: Sequence[str],
        netns: str | None = None,
        default_offload: OffloadPolicy = OffloadPolicy.ANY,
        reread_after: float = 1.0,
    ) -> None:
        self._patterns = tuple(ports)
        self._managed: dict[str, bool] = {}  # name -> whether a pattern matches it
        self._default_offload = default_offload
        self._reread_after = reread_after
        self._lock = threading.Lock()
        self._rules: dict[bytes, _Known] = {}  # by cookie: what we installed or were told
        self._ports: dict[int, _Port] = {}  # by ifindex: ingress filters as last read
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

    def remember(self, rules: Iterable[FlowRule]) -> None:
        """Rules an earlier process installed.

        `installed()` then names their filters, and the layout may group them with new
        rules (and move them).
        """
        with self._lock:
            self._rules.update((rule_cookie(rule.rule_id), self._know(rule)) for rule in rules)
            self._ports.clear()

    def managed(self, name: str) -> bool:
        """Whether a netdev name matches the managed patterns."""
        known = self._managed.get(name)
        if known is None:
            known = any(fnmatch.fnmatchcase(name, pattern) for pattern in self._patterns)
            if len(self._managed) < MANAGED_NAMES_KEPT:
                self._managed[name] = known
        return known

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
        """Add the rule's flower filter; all of it or nothing (a bulk change of one rule).

        Raises:
            InvalidArgument: the rule cannot be expressed as one flower filter.
            NotFound: the ingress port is not managed or absent, or a Forward/Mirror
                port does not exist.
            AlreadyExists: another rule of ours has its (ingress_port, priority), or
                someone else's filter is at that pref.
            FailedPrecondition: the kernel refused the filter (its reason is in the
                message); nothing is left changed. A clsact qdisc created for the
                rule stays on the port.
            Unavailable: rtnetlink could not be reached.
        """
        self._change([], [rule], fresh=False)

    def apply(self, remove: Sequence[FlowRule], install: Sequence[FlowRule]) -> None:
        """Remove and install rules as one unit, in one netlink batch (see the module doc).

        Raises as `install` does, before anything changes, for any rule of `install`
        (AlreadyExists also for two of them at one (port, priority)), and
        FailedPrecondition when the kernel refuses part of the batch: the batch is then
        undone (filters it deleted come back, with fresh counters).
        """
        self._change(remove, install, fresh=True)

    def remove(self, rule: FlowRule) -> None:
        """Delete the rule's filter (found by its cookie); no error if it is gone.

        A filter without the rule's cookie is left alone. No other filter moves.
        NotFound only when ingress_port is not a managed port name.
        """
        if not self.managed(rule.ingress_port):
            raise NotFound(f"{rule.ingress_port!r} is not a managed port")
        cookie = rule_cookie(rule.rule_id)
        with self._kernel(f"removing rule {rule.rule_id!r}"):
            ifindex = self._ifindex(rule.ingress_port)
            if ifindex is not None:
                port = self._port(ifindex)
                found = port.ours.get(cookie) or self._port(ifindex, fresh=True).ours.get(cookie)
                if found is not None:
                    try:
                        self._rtnl.request(
                            nl.RTM_DELTFILTER,
                            nl.NLM_F_REQUEST | nl.NLM_F_ACK,
                            delete_request(ifindex, found),
                        )
                    except nl.KernelError as exc:
                        self._ports.pop(ifindex, None)
                        if exc.code not in (errno.ENOENT, errno.ENODEV):
                            raise
                    else:
                        self._port(ifindex).drop(found, self._rules.get(cookie))
            self._rules.pop(cookie, None)

    def counters(self, rule: FlowRule) -> RuleCounters:
        """Packets and bytes the rule's first action saw, when, and whether in hardware."""
        cookie = rule_cookie(rule.rule_id)
        with self._kernel(f"reading the counters of rule {rule.rule_id!r}"):
            ifindex = self._managed_ifindex(rule.ingress_port)
            found = None
            for fresh in (False, True):
                placed = self._port(ifindex, fresh=fresh).ours.get(cookie)
                if placed is not None:
                    dumped = self._filters(ifindex, placed.pref)
                    found = next((f for f in dumped if f.cookie == cookie), None)
                if found is not None:
                    break
            now_ns = time.time_ns()
        if found is None:
            raise NotFound(f"rule {rule.rule_id!r} is not installed on {rule.ingress_port}")
        return _counters(found, now_ns)

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
                filters = {f.cookie: f for f in self._filters(links[port])}
                now_ns = time.time_ns()
                for rule in group:
                    f = filters.get(rule_cookie(rule.rule_id))
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
                filters = self._filters(ifindex)
                self._ports[ifindex] = self._classify(filters)
                rules += [
                    InstalledRule(
                        ingress_port=name, priority=self._priority(f), rule_id=self._rule_id(f)
                    )
                    for f in filters
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
        known = self._rules.get(f.cookie)
        return known.rule.rule_id if known else COOKIE_PREFIX + f.cookie.hex()

    def _priority(self, f: Filter) -> int:
        """A filter's rule priority.

        The rule's if known; else its handle (the agent's layout: handle = priority >=
        pref), or its pref (one filter per pref).
        """
        known = self._rules.get(f.cookie) if f.cookie is not None else None
        if known is not None:
            return known.rule.priority
        return f.handle if f.kind == "flower" and f.pref <= f.handle <= 0xFFFF else f.pref

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

    def _know(self, rule: FlowRule) -> _Known:
        """A rule with what the layout needs of it (its match compiled, no actions)."""
        protocol, keys, mask = flower_match(rule.match)
        policy = self._default_offload if rule.offload is OffloadPolicy.ANY else rule.offload
        group = mask_group(protocol, skip_flags(policy), mask)
        return _Known(rule, rule_cookie(rule.rule_id), group, keys)

    def _classify(self, filters: Iterable[Filter]) -> _Port:
        """Our known rules' filters by cookie; every other filter's pref is a barrier."""
        port = _Port(set(), time.monotonic())
        for f in filters:
            known = self._rules.get(f.cookie) if f.cookie is not None else None
            ours = known is not None and f.kind == "flower" and f.chain == 0
            if known is not None and ours and known.cookie not in port.ours:
                port.put(f, known)
            else:
                port.heads.add((f.pref, f.handle))
                port.barriers.add(f.pref)
        port.fences = sorted(port.barriers)
        return port

    def _port(self, ifindex: int, *, fresh: bool = False) -> _Port:
        """A port's ingress as last read.

        Read anew when `fresh`, never read, or older than `reread_after` seconds.
        """
        port = self._ports.get(ifindex)
        if fresh or port is None or time.monotonic() - port.read_at > self._reread_after:
            port = self._ports[ifindex] = self._classify(self._filters(ifindex))
        return port

    def _change(
        self, remove: Sequence[FlowRule], install: Sequence[FlowRule], *, fresh: bool
    ) -> None:
        """Remove and install rules in one batch, moving what the layout moves.

        `fresh` reads every involved port anew; otherwise the ports as last read (see
        `reread_after`), with the pref at each new rule's priority read again.
        """
        for rule in install:
            check_rule(rule)
        what = f"installing rule {install[0].rule_id!r}" if len(install) == 1 else "a bulk change"
        with self._kernel(what):
            ifindex_of = self._resolver()
            involved = self._involved(remove, install, ifindex_of)
            plans = [
                self._plan(ifindex, self._port(ifindex, fresh=fresh), gone, new, ifindex_of)
                for ifindex, (gone, new) in involved.items()
            ]
            if not fresh and any(self._stale(plan) for plan in plans):
                self._ports.clear()
                plans = [
                    self._plan(ifindex, self._port(ifindex, fresh=True), gone, new, ifindex_of)
                    for ifindex, (gone, new) in involved.items()
                ]
            for plan in plans:
                if plan.adds:
                    self._ensure_clsact(plan.ifindex)
            self._run(plans)
            self._commit(remove, plans)

    def _commit(self, remove: Sequence[FlowRule], plans: Sequence[_Plan]) -> None:
        """Record what a batch the kernel took changed."""
        for plan in plans:
            port = self._ports.get(plan.ifindex)
            if port is not None:
                for f in (*plan.deletes, *plan.moves):
                    port.drop(f, self._rules.get(f.cookie) if f.cookie is not None else None)
        for rule in remove:
            self._rules.pop(rule_cookie(rule.rule_id), None)
        for plan in plans:
            self._rules.update(plan.known)
            port = self._ports.get(plan.ifindex)
            if port is not None:
                for cookie, f in plan.placed.items():
                    port.put(f, self._rules[cookie])

    def _involved(
        self,
        remove: Sequence[FlowRule],
        install: Sequence[FlowRule],
        ifindex_of: Callable[[str], int | None],
    ) -> dict[int, tuple[list[FlowRule], list[FlowRule]]]:
        """(rules to remove, rules to install) by ifindex; NotFound for unknown ports."""
        involved: dict[int, tuple[list[FlowRule], list[FlowRule]]] = {}
        for rule in (*remove, *install):
            if not self.managed(rule.ingress_port):
                raise NotFound(f"{rule.ingress_port!r} is not a managed port")
        for rule in remove:
            ifindex = ifindex_of(rule.ingress_port)
            if ifindex is not None:
                involved.setdefault(ifindex, ([], []))[0].append(rule)
        for rule in install:
            ifindex = ifindex_of(rule.ingress_port)
            if ifindex is None:
                raise NotFound(f"no port named {rule.ingress_port!r}")
            for name in action_ports(rule.actions):
                if ifindex_of(name) is None:
                    raise NotFound(f"no port named {name!r} to forward or mirror to")
            involved.setdefault(ifindex, ([], []))[1].append(rule)
        return involved

    def _resolver(self) -> Callable[[str], int | None]:
        """Look up ifindexes by name, each name once."""
        names: dict[str, int | None] = {}

        def ifindex_of(name: str) -> int | None:
            if name not in names:
                names[name] = self._ifindex(name)
            return names[name]

        return ifindex_of

    def _plan(
        self,
        ifindex: int,
        port: _Port,
        gone: Sequence[FlowRule],
        new: Sequence[FlowRule],
        ifindex_of: Callable[[str], int | None],
    ) -> _Plan:
        """The requests that take one port from its state to the one after the change."""
        if not gone and len(new) == 1:
            fast = self._plan_one(ifindex, port, new[0], ifindex_of)
            if fast is not None:
                return fast
        compiled: dict[bytes, CompiledFilter] = {}
        adding: dict[bytes, _Known] = {}
        for rule in new:
            c = self._compile(rule, ifindex_of)
            known = _Known(rule, c.cookie, c.group, c.key)
            compiled[known.cookie] = c
            adding[known.cookie] = known
        leaving = {rule_cookie(rule.rule_id) for rule in gone} | set(adding)
        final: list[tuple[_Known, Filter | None]] = [
            (self._rules[c], f) for c, f in port.ours.items() if c not in leaving
        ]
        final += [(known, None) for known in adding.values()]
        taken = collections.Counter(known.rule.priority for known, _ in final)
        for known in adding.values():
            rule = known.rule
            if taken[rule.priority] > 1 or rule.priority in port.barriers:
                raise AlreadyExists(
                    f"{rule.ingress_port} already has a filter at priority {rule.priority}"
                )
        slots = [
            Slot(k.rule.priority, k.group, k.key, None if f is None else f.pref) for k, f in final
        ]
        where = place(slots, port.barriers)
        plan = _Plan(ifindex, deletes=[f for c, f in port.ours.items() if c in leaving])
        plan.known = adding
        moving = [(k, f) for k, f in final if f is None or where[k.rule.priority] != f.pref]
        plan.moves = [f for _, f in moving if f is not None]
        moved_from = {f.pref for f in plan.moves}
        early: list[tuple[CompiledFilter, int, str]] = []
        late: list[tuple[CompiledFilter, int, str]] = []
        for known, f in moving:
            rule, pref = known.rule, where[known.rule.priority]
            c = compiled.get(known.cookie) or self._compile(rule, ifindex_of, moving=True)
            label = f"rule {rule.rule_id!r}" + (" (moved)" if f is not None else "")
            (late if pref in moved_from else early).append((c, pref, label))
            plan.placed[known.cookie] = c.placed(pref)
        plan.adds, plan.split = early + late, len(early)
        return plan

    def _plan_one(
        self,
        ifindex: int,
        port: _Port,
        rule: FlowRule,
        ifindex_of: Callable[[str], int | None],
    ) -> _Plan | None:
        """One new rule that moves nothing: into its neighbour's run, or a pref of its own.

        In time independent of the rules on the port. None when the rule would split a
        run (or replaces one of ours): the whole port's layout is needed then.
        """
        compiled = self._compile(rule, ifindex_of)
        known = _Known(rule, compiled.cookie, compiled.group, compiled.key)
        p = rule.priority
        if known.cookie in port.ours:
            return None
        if p in port.barriers or p in port.by_priority:
            raise AlreadyExists(f"{rule.ingress_port} already has a filter at priority {p}")
        index = bisect.bisect_left(port.order, p)
        below = port.ours[port.by_priority[port.order[index - 1]]] if index else None
        above = port.ours[port.by_priority[port.order[index]]] if index < len(port.order) else None
        pref = None
        for neighbour, lower in ((below, True), (above, False)):
            if neighbour is None or neighbour.cookie is None:
                continue
            other = self._rules[neighbour.cookie]
            between = (other.rule.priority, p) if lower else (p, other.rule.priority)
            if (
                other.group == known.group
                and known.key not in port.keys.get(neighbour.pref, set())
                and not port.fence_between(*between)
            ):
                pref = neighbour.pref
                break
        if pref is None:
            if below is not None and above is not None and below.pref == above.pref:
                return None  # inside a run it cannot join: the run splits
            floor = max(below.pref if below else 0, port.fence_below(p)) + 1
            ceiling = min(above.pref if above else MAX_PREF + 1, port.fence_above(p)) - 1
            pref = max(floor, min(p, ceiling))
            if not floor <= pref <= ceiling:
                return None
        plan = _Plan(ifindex, deletes=[], known={known.cookie: known}, split=1)
        plan.adds = [(compiled, pref, f"rule {rule.rule_id!r}")]
        plan.placed[known.cookie] = compiled.placed(pref)
        return plan

    def _compile(
        self, rule: FlowRule, ifindex_of: Callable[[str], int | None], *, moving: bool = False
    ) -> CompiledFilter:
        """The rule's filter, its forward and mirror ports resolved."""
        targets = {name: ifindex_of(name) for name in action_ports(rule.actions)}
        missing = [name for name, index in targets.items() if index is None]
        if missing:
            if moving:
                raise FailedPrecondition(
                    f"rule {rule.rule_id!r} must move to make room, but its port"
                    f" {missing[0]!r} is gone"
                )
            raise NotFound(f"no port named {missing[0]!r} to forward or mirror to")
        resolved = {name: index for name, index in targets.items() if index is not None}
        return compile_rule(rule, resolved, self._default_offload, check=False)

    def _stale(self, plan: _Plan) -> bool:
        """Whether a filter not there when the port was read is at a new rule's priority.

        Someone else's filter there refuses the rule.
        """
        heads = self._ports[plan.ifindex].heads
        for known in plan.known.values():
            for f in self._filters(plan.ifindex, known.rule.priority):
                if (f.pref, f.handle) not in heads:
                    return True
        return False

    @staticmethod
    def _requests(plans: Sequence[_Plan]) -> list[tuple[tuple[int, int, bytes], str | None]]:
        """The batch, labelled: deletes, safe adds, moved-out deletes, then late adds.

        A delete's label is None; an add's names its rule.
        """

        def deletes(*, moved: bool) -> list[tuple[tuple[int, int, bytes], str | None]]:
            return [
                ((nl.RTM_DELTFILTER, nl.NLM_F_REQUEST, delete_request(p.ifindex, f)), None)
                for p in plans
                for f in (p.moves if moved else p.deletes)
            ]

        def adds(*, early: bool) -> list[tuple[tuple[int, int, bytes], str | None]]:
            return [
                ((nl.RTM_NEWTFILTER, _NEW_FILTER, compiled.new_request(p.ifindex, pref)), label)
                for p in plans
                for compiled, pref, label in (p.adds[: p.split] if early else p.adds[p.split :])
            ]

        return [
            *deletes(moved=False),
            *adds(early=True),
            *deletes(moved=True),
            *adds(early=False),
        ]

    def _run(self, plans: Sequence[_Plan]) -> None:
        """Send the plans as one batch; undo it all if the kernel refuses any of it."""
        labelled = self._requests(plans)
        requests = [request for request, _ in labelled]
        labels = [label for _, label in labelled]
        try:
            refused = self._rtnl.batch(requests)
        except nl.KernelError as exc:  # answers lost: which took is unknown
            refused = {len(requests): exc}
        refused = {
            i: e
            for i, e in refused.items()
            if i >= len(requests)
            or labels[i] is not None
            or e.code not in (errno.ENOENT, errno.ENODEV)
        }
        if not refused:
            return
        index = min(refused)
        self._undo(plans)
        label = labels[index] if index < len(requests) else None
        raise FailedPrecondition(
            f"the kernel refused {label or 'the batch'}: {refused[index]}; nothing was changed"
        )

    def _undo(self, plans: Sequence[_Plan]) -> None:
        """Put the filters a refused batch touched back as they were before it."""
        requests = []
        for plan in plans:
            before = self._ports.pop(plan.ifindex)
            touched = {f.cookie for f in (*plan.deletes, *plan.moves)} | set(plan.placed)
            wanted = {c: f for c, f in before.ours.items() if c in touched}
            now = self._filters(plan.ifindex)
            present = {(f.cookie, f.pref, f.handle) for f in now}
            requests += [
                (nl.RTM_DELTFILTER, nl.NLM_F_REQUEST, delete_request(plan.ifindex, f))
                for f in now
                if f.cookie is not None
                and f.cookie in touched
                and not _same_place(wanted.get(f.cookie), f)
            ]
            for cookie, f in wanted.items():
                if (cookie, f.pref, f.handle) in present:
                    continue
                rule = self._rules[cookie].rule
                targets = {name: self._ifindex(name) for name in action_ports(rule.actions)}
                compiled = dataclasses.replace(
                    compile_rule(rule, targets, self._default_offload, check=False),  # type: ignore[arg-type]
                    handle=f.handle,
                )
                requests.append(
                    (nl.RTM_NEWTFILTER, _NEW_FILTER, compiled.new_request(plan.ifindex, f.pref))
                )
        refused = self._rtnl.batch(requests)
        if refused:
            raise Unavailable(
                f"a refused bulk change could not be undone ({refused[min(refused)]});"
                " the datapath may differ from the rules: restart the agent to reconcile"
            )


def _same_place(a: Filter | None, b: Filter) -> bool:
    return a is not None and (a.pref, a.handle) == (b.pref, b.handle)


@dataclasses.dataclass(frozen=True)
class _Known:
    """A rule of ours and what the layout needs of it."""

    rule: FlowRule
    cookie: bytes
    group: tuple[object, ...]
    key: bytes


@dataclasses.dataclass
class _Port:
    """A port's ingress as last read, kept up to date with the agent's own changes.

    Our known rules' filters by cookie and by priority (in order), the keys each pref
    holds, and the prefs of every other filter (barriers).
    """

    barriers: set[int]
    read_at: float  # time.monotonic() of the read
    ours: dict[bytes, Filter] = dataclasses.field(default_factory=dict)
    heads: set[tuple[int, int]] = dataclasses.field(default_factory=set)  # (pref, handle)
    order: list[int] = dataclasses.field(default_factory=list)  # our priorities, sorted
    by_priority: dict[int, bytes] = dataclasses.field(default_factory=dict)  # -> cookie
    keys: dict[int, set[bytes]] = dataclasses.field(default_factory=dict)  # pref -> keys
    fences: list[int] = dataclasses.field(default_factory=list)  # barriers, sorted

    def put(self, f: Filter, known: _Known) -> None:
        """One of our filters is now at f.pref."""
        self.ours[known.cookie] = f
        self.heads.add((f.pref, f.handle))
        bisect.insort(self.order, known.rule.priority)
        self.by_priority[known.rule.priority] = known.cookie
        self.keys.setdefault(f.pref, set()).add(known.key)

    def drop(self, f: Filter, known: _Known | None) -> None:
        """A filter is gone (known: the rule it was, if ours)."""
        self.heads.discard((f.pref, f.handle))
        if known is None or self.ours.get(known.cookie) != f:
            return
        del self.ours[known.cookie]
        priority = known.rule.priority
        if self.by_priority.get(priority) == known.cookie:
            del self.by_priority[priority]
            index = bisect.bisect_left(self.order, priority)
            if index < len(self.order) and self.order[index] == priority:
                del self.order[index]
        self.keys.get(f.pref, set()).discard(known.key)

    def fence_between(self, low: int, high: int) -> bool:
        """Whether a barrier lies strictly between two priorities."""
        index = bisect.bisect_right(self.fences, low)
        return index < len(self.fences) and self.fences[index] < high

    def fence_below(self, priority: int) -> int:
        """The highest barrier below a priority, or 0."""
        index = bisect.bisect_left(self.fences, priority)
        return self.fences[index - 1] if index else 0

    def fence_above(self, priority: int) -> int:
        """The lowest barrier above a priority, or MAX_PREF + 1."""
        index = bisect.bisect_right(self.fences, priority)
        return self.fences[index] if index < len(self.fences) else MAX_PREF + 1


@dataclasses.dataclass
class _Plan:
    """One port's part of a batch."""

    ifindex: int
    deletes: list[Filter]  # filters of removed or replaced rules: first
    moves: list[Filter] = dataclasses.field(default_factory=list)  # old places of moved ones
    adds: list[tuple[CompiledFilter, int, str]] = dataclasses.field(default_factory=list)
    split: int = 0  # adds[:split] go before the moves' deletes, adds[split:] after
    placed: dict[bytes, Filter] = dataclasses.field(default_factory=dict)  # new places
    known: dict[bytes, _Known] = dataclasses.field(default_factory=dict)  # installed rules


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
