"""The agent's flow rules: validated, programmed into the datapath, saved, reconciled.

The table is the one writer of the datapath's rules on managed ports. Every change
goes to the datapath first and is saved only if it took; a failure rolls back, so
the saved rules, the table and the datapath agree. On start the saved rules are
re-applied, and filters the agent did not make are reported.

A rule belongs to a tenant, and a caller checks that it may touch a rule before it
asks the table to change it; an id can change hands in between (its rule deleted,
another tenant's created under the id). So every change that names an existing rule
checks the owner again under the table's lock: an update never changes a rule's
tenant, and a delete (alone or in a bulk change) may name the tenant the caller found.
A rule of another tenant then answers NotFound with a missing rule's text.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from typing import TYPE_CHECKING

from dpu_agent.errors import AlreadyExists, InvalidArgument, NotFound
from dpu_agent.network.validate import check_rule

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

    from dpu_agent.network.backend import FlowBackend
    from dpu_agent.network.model import FlowRule, InstalledRule, PortInfo, RuleCounters
    from dpu_agent.network.rulestore import RuleStore

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Reconciliation:
    """What start-up found: rules re-applied, rules that failed, filters not ours."""

    reapplied: tuple[str, ...] = ()
    present: tuple[str, ...] = ()
    failed: tuple[tuple[str, str], ...] = ()
    foreign: tuple[InstalledRule, ...] = ()


@dataclasses.dataclass(frozen=True)
class Changes:
    """A bulk change: rules to create, rules replacing others of their id, ids to delete."""

    create: tuple[FlowRule, ...] = ()
    update: tuple[FlowRule, ...] = ()
    delete: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Applied:
    """What a bulk change did (or, validating only, would do)."""

    created: tuple[FlowRule, ...]
    updated: tuple[FlowRule, ...]
    deleted: tuple[FlowRule, ...]


def _check_ids(changes: Changes) -> None:
    """InvalidArgument if an id is created, updated or deleted twice, or updated and deleted."""
    created = [r.rule_id for r in changes.create]
    updated = [r.rule_id for r in changes.update]
    for ids in (created + updated, updated + list(changes.delete)):
        twice = [i for i, n in collections.Counter(ids).items() if n > 1]
        if twice:
            raise InvalidArgument(f"flowRules/{twice[0]} is changed more than once")


class FlowTable:
    """Flow rules by id, backed by a datapath and a rule store. Thread-safe."""

    def __init__(self, backend: FlowBackend, store: RuleStore) -> None:
        self._backend = backend
        self._store = store
        self._rules: dict[str, FlowRule] = {}
        self._lock = threading.Lock()
        self.foreign: tuple[InstalledRule, ...] = ()

    def start(self) -> Reconciliation:
        """Load the saved rules and make the datapath hold them again."""
        with self._lock:
            saved = self._store.load()
            self._backend.remember(saved)
            installed = self._backend.installed()
            ours = {(i.ingress_port, i.priority): i.rule_id for i in installed}
            reapplied, present, failed = [], [], []
            missing = []
            for rule in saved:
                self._rules[rule.rule_id] = rule
                if ours.get((rule.ingress_port, rule.priority)) == rule.rule_id:
                    present.append(rule.rule_id)
                else:
                    missing.append(rule)
            try:  # all at once (tc: one batch); if any fails, one by one to know which
                self._backend.apply([], missing)
                reapplied = [rule.rule_id for rule in missing]
                missing = []
            except Exception:  # noqa: BLE001 - the rules are tried one by one below
                log.info("re-applying the rules one by one", extra={"rules": len(missing)})
            for rule in missing:
                try:
                    self._backend.install(rule)
                    reapplied.append(rule.rule_id)
                except Exception as exc:  # noqa: BLE001 - reported, the agent starts anyway
                    failed.append((rule.rule_id, str(exc)))
                    log.warning(
                        "cannot re-apply rule", extra={"rule": rule.rule_id, "error": str(exc)}
                    )
            known = set(self._rules)
            self.foreign = tuple(i for i in installed if i.rule_id not in known)
            for item in self.foreign:
                log.warning(
                    "a filter the agent did not make is on a managed port",
                    extra={"port": item.ingress_port, "priority": item.priority},
                )
            return Reconciliation(tuple(reapplied), tuple(present), tuple(failed), self.foreign)

    def ports(self) -> list[PortInfo]:
        """The managed ports."""
        return self._backend.ports()

    def create(self, rule: FlowRule) -> FlowRule:
        """Validate, program and save a new rule."""
        with self._lock:
            if rule.rule_id in self._rules:
                raise AlreadyExists(f"flowRules/{rule.rule_id} already exists")
            self._check(rule, replacing=None)
            self._backend.install(rule)
            self._rules[rule.rule_id] = rule
            try:
                self._save()
            except BaseException:
                del self._rules[rule.rule_id]
                self._backend.remove(rule)
                raise
            return rule

    def update(self, rule: FlowRule) -> FlowRule:
        """Replace a rule of the same tenant; if the new one does not take, the old one stays.

        NotFound, as for a missing rule, if the rule of that id is another tenant's.
        """
        with self._lock:
            old = self._get(rule.rule_id, rule.tenant)
            self._check(rule, replacing=old)
            self._backend.remove(old)
            try:
                self._backend.install(rule)
            except BaseException:
                self._backend.install(old)
                raise
            self._rules[rule.rule_id] = rule
            try:
                self._save()
            except BaseException:
                self._rules[rule.rule_id] = old
                self._backend.remove(rule)
                self._backend.install(old)
                raise
            return rule

    def apply(
        self,
        changes: Changes,
        *,
        validate_only: bool = False,
        owners: Mapping[str, str] | None = None,
    ) -> Applied:
        """Create, update and delete rules as one unit: all of them or none.

        Every rule is checked, ids must be new (create) or known (update, delete) and
        appear once (a rule both deleted and created is replaced, e.g. to move it to
        another port), and no two rules of the result share a (port, priority); then
        the datapath gets the whole change at once and the store is saved once. If
        anything fails, the datapath, the table and the store stay as they were.

        An update must keep its rule's tenant, and `owners` (rule id -> tenant) gives
        the tenant a delete expects; a rule of another tenant answers NotFound as a
        missing one does.
        """
        with self._lock:
            _check_ids(changes)
            for rule in changes.create:
                if rule.rule_id in self._rules and rule.rule_id not in changes.delete:
                    raise AlreadyExists(f"flowRules/{rule.rule_id} already exists")
            old = [self._get(r.rule_id, r.tenant) for r in changes.update]
            expected = owners or {}
            gone = [self._get(rule_id, expected.get(rule_id)) for rule_id in changes.delete]
            ports = {p.name for p in self._backend.ports()}
            result = dict(self._rules)
            for rule in (*old, *gone):
                del result[rule.rule_id]
            slots = {(r.ingress_port, r.priority): r for r in result.values()}
            for rule in (*changes.update, *changes.create):
                check_rule(rule, ports)
                other = slots.get((rule.ingress_port, rule.priority))
                if other is not None:
                    self._check_free(rule, (other,))
                slots[rule.ingress_port, rule.priority] = rule
                result[rule.rule_id] = rule
            applied = Applied(changes.create, changes.update, tuple(gone))
            if validate_only:
                return applied
            remove = [*old, *gone]
            install = [*changes.update, *changes.create]
            self._backend.apply(remove, install)
            before, self._rules = self._rules, result
            try:
                self._save()
            except BaseException:
                self._rules = before
                self._backend.apply(install, remove)
                raise
            return applied

    def delete(self, rule_id: str, owner: str | None = None) -> None:
        """Remove a rule (of tenant `owner`, when given) from the datapath and the store."""
        with self._lock:
            rule = self._get(rule_id, owner)
            self._backend.remove(rule)
            del self._rules[rule_id]
            try:
                self._save()
            except BaseException:
                self._rules[rule_id] = rule
                self._backend.install(rule)
                raise

    def get(self, rule_id: str) -> FlowRule:
        """One rule."""
        with self._lock:
            return self._get(rule_id)

    def rules(self, port: str | None = None) -> list[FlowRule]:
        """Every rule (on one port), by id."""
        with self._lock:
            chosen = [r for r in self._rules.values() if port is None or r.ingress_port == port]
        return sorted(chosen, key=lambda r: r.rule_id)

    def counters(self, rule_id: str, owner: str | None = None) -> RuleCounters:
        """What the datapath counted for a rule (of tenant `owner`, when given)."""
        with self._lock:
            rule = self._get(rule_id, owner)
        return self._backend.counters(rule)

    def counters_many(
        self, rule_ids: Iterable[str], owner: str | None = None
    ) -> dict[str, RuleCounters]:
        """Counters of many rules in one read of the datapath.

        Unknown ids, and rules of a tenant other than `owner` when it is given, are left out.
        """
        with self._lock:
            rules = [
                r
                for r in (self._rules.get(i) for i in rule_ids)
                if r is not None and (owner is None or r.tenant == owner)
            ]
        return self._backend.counters_many(rules)

    def _get(self, rule_id: str, owner: str | None = None) -> FlowRule:
        """The rule; NotFound if there is none, or it is not tenant `owner`'s (when given)."""
        rule = self._rules.get(rule_id)
        if rule is None or (owner is not None and rule.tenant != owner):
            raise NotFound(f"flowRules/{rule_id} does not exist")
        return rule

    def _check(self, rule: FlowRule, replacing: FlowRule | None) -> None:
        check_rule(rule, {p.name for p in self._backend.ports()})
        self._check_free(rule, (r for r in self._rules.values() if r is not replacing))

    @staticmethod
    def _check_free(rule: FlowRule, others: Iterable[FlowRule]) -> None:
        for other in others:
            if (other.ingress_port, other.priority) == (rule.ingress_port, rule.priority):
                holder = f"flowRules/{other.rule_id}" if other.tenant == rule.tenant else "a rule"
                raise AlreadyExists(  # another tenant's rule is not named
                    f"{holder} already has priority {rule.priority} on port {rule.ingress_port}"
                )

    def _save(self) -> None:
        self._store.save(list(self._rules.values()))
