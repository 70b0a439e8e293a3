"""The function manager: records, transactions and the checks around the backend.

Life of a create:

1. checks: the id is new, the spec is valid, a block function's volume exists and no
   other function exports it;
2. the record is saved as CREATING (so a crash from here on is recoverable);
3. the backend makes the function, all or nothing;
4. the record is saved as READY with what was made.

Any failure in steps 2 to 4 undoes the steps before it (the backend's own rollback, then the
export claim and the record), so nothing half-made remains. After a crash, `start()`
finds CREATING and DELETING records and asks the backend to remove whatever is left
of them by the function id.

A delete is refused with FailedPrecondition while a flow rule names the function's
representor port (as its ingress port or in an action) or while the backend reports
the function busy (its block device mounted on the host side). The refusal names the
rules of the function's own tenant and only counts the others (an admin's), so it
never tells one tenant another's rule ids.

A function's representor port belongs to its tenant: `port_owners()` tells the
network service whose each port is (`dpu_agent.network.access`), and holds ownership
still while a rule is checked and created, so a port cannot change hands meanwhile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from typing import TYPE_CHECKING

from dpu_agent.errors import AgentError, AlreadyExists, FailedPrecondition, NotFound
from dpu_agent.network.model import Forward, Mirror
from dpu_agent.quota import Quotas
from dpu_agent.virtualization.model import (
    MUTABLE_FIELDS,
    FunctionRecord,
    FunctionSpec,
    FunctionState,
    Provisioned,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping

    from dpu_agent.network.model import FlowRule
    from dpu_agent.storage.backend import VolumeStore
    from dpu_agent.storage.exports import VolumeExports
    from dpu_agent.virtualization.backend import FunctionBackend
    from dpu_agent.virtualization.store import FunctionStore

log = logging.getLogger(__name__)

MAX_FUNCTIONS = 1024


def holder_name(function_id: str) -> str:
    """How an exported volume names its function."""
    return f"functions/{function_id}"


def rules_on_port(rules: list[FlowRule], port: str) -> list[FlowRule]:
    """The rules that match on `port` or send packets to it."""
    return [
        r
        for r in rules
        if r.ingress_port == port
        or any(isinstance(a, Forward | Mirror) and a.port == port for a in r.actions)
    ]


def _rules_in_the_way(users: list[FlowRule], tenant: str) -> str:
    """The rules that keep a function of `tenant` alive: its own by id, others counted."""
    own = [r.rule_id for r in users if r.tenant == tenant]
    others = len(users) - len(own)
    parts = []
    if own:
        more = f" and {len(own) - 5} more" if len(own) > 5 else ""
        parts.append(f"flow rule(s) {', '.join(own[:5])}{more}")
    if others:
        parts.append(f"{others} flow rule(s) of another tenant (an admin can remove them)")
    return " and ".join(parts)


@dataclasses.dataclass(frozen=True)
class Recovery:
    """What `start()` found: functions kept, restored, cleaned up, or failed."""

    kept: tuple[str, ...] = ()
    restored: tuple[str, ...] = ()
    cleaned: tuple[str, ...] = ()
    failed: tuple[tuple[str, str], ...] = ()


class FunctionManager:
    """Functions by id, backed by a backend and a record store. Thread-safe."""

    def __init__(  # noqa: PLR0913 - the manager's collaborators, injected
        self,
        backend: FunctionBackend,
        store: FunctionStore,
        *,
        volumes: VolumeStore | None = None,
        exports: VolumeExports | None = None,
        flow_rules: Callable[[], list[FlowRule]] | None = None,
        max_functions: int = MAX_FUNCTIONS,
        quotas: Quotas | None = None,
    ) -> None:
        self.backend = backend
        self._store = store
        self._volumes = volumes
        self._exports = exports
        self._flow_rules = flow_rules or list
        self._max = max_functions
        self._quotas = quotas or Quotas()
        self._records: dict[str, FunctionRecord] = {}
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ start
    def start(self) -> Recovery:
        """Load the saved records and bring the backend in line with them."""
        kept, restored, cleaned, failed = [], [], [], []
        with self._lock:
            for record in self._store.load():
                spec = record.spec
                made = record.provisioned or Provisioned("", "")
                if record.state in {FunctionState.CREATING, FunctionState.DELETING}:
                    try:
                        self.backend.delete(spec, made)
                        cleaned.append(spec.function_id)
                    except AgentError as exc:
                        failed.append((spec.function_id, str(exc)))
                        self._records[spec.function_id] = self._with(record, FunctionState.FAILED)
                    continue
                self._records[spec.function_id] = record
                if spec.type.is_block and self._exports is not None:
                    self._exports.claim(spec.volume_id, holder_name(spec.function_id))
                if record.state is not FunctionState.READY:
                    continue
                try:
                    if self.backend.present(spec, made):
                        made2 = self.backend.restore(spec, made)
                        if made2 != made:
                            self._records[spec.function_id] = dataclasses.replace(
                                record, provisioned=made2
                            )
                            restored.append(spec.function_id)
                        else:
                            kept.append(spec.function_id)
                    else:
                        made2 = self.backend.create(spec)
                        self._records[spec.function_id] = dataclasses.replace(
                            record, provisioned=made2
                        )
                        restored.append(spec.function_id)
                except AgentError as exc:
                    failed.append((spec.function_id, str(exc)))
                    self._records[spec.function_id] = self._with(record, FunctionState.FAILED)
                    log.warning(
                        "cannot restore function",
                        extra={"function": spec.function_id, "error": str(exc)},
                    )
            self._save()
        return Recovery(tuple(kept), tuple(restored), tuple(cleaned), tuple(failed))

    # ------------------------------------------------------------------ reads
    def get(self, function_id: str) -> FunctionRecord:
        """One function."""
        with self._lock:
            return self._get(function_id)

    def list(self) -> list[FunctionRecord]:
        """Every function, by id."""
        with self._lock:
            return [self._records[k] for k in sorted(self._records)]

    @contextlib.contextmanager
    def port_owners(self) -> Iterator[dict[str, str]]:
        """Representor port -> tenant of its function; no function changes meanwhile."""
        with self._lock:
            yield {port: r.spec.tenant for port, r in self._by_representor().items()}

    def port_functions(self) -> dict[str, str]:
        """Representor port -> the id of the function it represents."""
        with self._lock:
            return {port: r.spec.function_id for port, r in self._by_representor().items()}

    def by_port(self, port: str) -> FunctionRecord | None:
        """The function whose representor is `port`, if any."""
        with self._lock:
            return self._by_representor().get(port)

    def _by_representor(self) -> dict[str, FunctionRecord]:
        """Representor port -> its function (the lock held)."""
        return {
            r.provisioned.representor_port: r
            for r in self._records.values()
            if r.provisioned is not None and r.provisioned.representor_port
        }

    # ------------------------------------------------------------------ create
    def create(self, spec: FunctionSpec) -> FunctionRecord:
        """Make a function, all of it or nothing."""
        with self._lock:
            if spec.function_id in self._records:
                raise AlreadyExists(f"functions/{spec.function_id} already exists")
            owned = [r.spec for r in self._records.values() if r.spec.tenant == spec.tenant]
            blocks = sum(1 for s in owned if s.type.is_block)
            self._quotas.check_functions(
                spec.tenant, len(owned) + 1, blocks + 1 if spec.type.is_block else 0
            )
            self._check_mac_free(spec.mac, spec.function_id)
            if len(self._records) >= self._max:
                raise FailedPrecondition(f"this agent manages at most {self._max} functions")
            claimed = self._claim_volume(spec)
            now = time.time_ns()
            record = FunctionRecord(spec, None, FunctionState.CREATING, now, now)
            try:
                self._records[spec.function_id] = record
                self._save()
                made = self.backend.create(spec)
            except BaseException:
                self._records.pop(spec.function_id, None)
                if claimed:
                    self._release_volume(spec)
                self._save_quietly()
                raise
            record = FunctionRecord(spec, made, FunctionState.READY, now, time.time_ns())
            self._records[spec.function_id] = record
            try:
                self._save()
            except BaseException:
                self.backend.delete(spec, made)
                self._records.pop(spec.function_id, None)
                if claimed:
                    self._release_volume(spec)
                raise
            log.info(
                "function created",
                extra={
                    "function": spec.function_id,
                    "type": str(spec.type),
                    "port": made.representor_port,
                    "device": made.host_device,
                },
            )
            return record

    def _claim_volume(self, spec: FunctionSpec) -> bool:
        if not spec.type.is_block:
            return False
        if self._volumes is None:
            raise FailedPrecondition("this agent has no volume store")
        self._volumes.get(spec.volume_id)  # NotFound if it does not exist
        if self._exports is not None:
            self._exports.claim(spec.volume_id, holder_name(spec.function_id))
            return True
        return False

    def _release_volume(self, spec: FunctionSpec) -> None:
        if self._exports is not None:
            self._exports.release(spec.volume_id, holder_name(spec.function_id))

    # ------------------------------------------------------------------ update
    def update(self, function_id: str, changes: Mapping[str, object]) -> FunctionRecord:
        """Change mutable fields; if the backend refuses, the function stays as it was."""
        with self._lock:
            record = self._get(function_id)
            unknown = set(changes) - MUTABLE_FIELDS
            if unknown:
                fields = ", ".join(sorted(unknown))
                raise FailedPrecondition(f"cannot change {fields} of a function")
            if record.state is not FunctionState.READY or record.provisioned is None:
                raise FailedPrecondition(f"functions/{function_id} is {record.state}, not ready")
            new = dataclasses.replace(record.spec, **changes)  # type: ignore[arg-type]
            if new == record.spec:
                return record
            if new.mac != record.spec.mac:
                self._check_mac_free(new.mac, function_id)
            made = self.backend.update(record.spec, new, record.provisioned)
            updated = FunctionRecord(new, made, record.state, record.created_ns, time.time_ns())
            self._records[function_id] = updated
            self._save()
            return updated

    def _check_mac_free(self, mac: str, function_id: str) -> None:
        """FailedPrecondition if another function has `mac` (asked for, or its device's)."""
        if not mac:
            return
        for other in self._records.values():
            if other.spec.function_id == function_id:
                continue
            theirs = {other.spec.mac}
            if other.provisioned is not None:
                theirs.add(str(other.provisioned.facts.get("mac", "")))
            if mac in theirs:
                raise FailedPrecondition(
                    f"function.mac_address {mac} is another function's (each must be unique)"
                )

    # ------------------------------------------------------------------ delete
    def delete(self, function_id: str) -> None:
        """Remove a function; refused while a flow rule or a mounted filesystem uses it."""
        with self._lock:
            record = self._get(function_id)
            spec, made = record.spec, record.provisioned or Provisioned("", "")
            if made.representor_port:
                users = rules_on_port(self._flow_rules(), made.representor_port)
                if users:
                    raise FailedPrecondition(
                        f"functions/{function_id}: its port {made.representor_port} is used by "
                        f"{_rules_in_the_way(users, spec.tenant)}; delete them first"
                    )
            reason = self.backend.busy(spec, made)
            if reason:
                raise FailedPrecondition(f"functions/{function_id} is in use: {reason}")
            self._records[function_id] = self._with(record, FunctionState.DELETING)
            self._save()
            try:
                self.backend.delete(spec, made)
            except BaseException:
                self._records[function_id] = self._with(record, FunctionState.FAILED)
                self._save_quietly()
                raise
            del self._records[function_id]
            if spec.type.is_block:
                self._release_volume(spec)
            self._save()
            log.info("function deleted", extra={"function": function_id})

    def close(self) -> None:
        """Release the backend (exports served by this process end)."""
        self.backend.close()

    # ------------------------------------------------------------------ helpers
    def _get(self, function_id: str) -> FunctionRecord:
        record = self._records.get(function_id)
        if record is None:
            raise NotFound(f"functions/{function_id} does not exist")
        return record

    @staticmethod
    def _with(record: FunctionRecord, state: FunctionState) -> FunctionRecord:
        return dataclasses.replace(record, state=state, updated_ns=time.time_ns())

    def _save(self) -> None:
        self._store.save(list(self._records.values()))

    def _save_quietly(self) -> None:
        try:
            self._save()
        except OSError as exc:
            log.warning("cannot save function records", extra={"error": str(exc)})
