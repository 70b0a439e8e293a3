"""Per-tenant quotas (`[quota]` in the configuration); 0 means no limit.

Each check takes what the tenant would hold if the call went through and raises
ResourceExhausted (RESOURCE_EXHAUSTED on the wire) naming the quota, the tenant's use
and the limit. Callers make check-and-create atomic (a lock, or a reservation) so two
concurrent calls cannot both slip under a limit. Admins are bound like everyone else.

- max_volumes, max_volume_bytes: volumes a tenant owns and their total size (create,
  resize). A volume holds no bytes until it is written, so only a count bounds the
  volumes of a tenant without max_volume_bytes: max_volumes is on by default (1024;
  a clone counts). Enforced by the StorageService.
- max_snapshots: snapshots a tenant owns (they outlive their volumes, and one of an
  empty volume holds no bytes: only a count bounds them). On by default (1024).
  Enforced by the StorageService.
- max_sessions, max_queue_depth: open sessions and the sum of their queue depths,
  i.e. the jobs a tenant may have in flight at once. Enforced by the SessionManager.
- max_flow_rules: flow rules a tenant owns (1024 by default: each one costs every
  later change of the rule table). Enforced by the NetworkService.
- max_functions: functions a tenant owns (64 by default: the agent's 1024, and the
  NIC's VFs and SFs, are shared by every tenant). Enforced by the FunctionManager.
- max_block_functions: of them, block functions (virtio-blk, NVMe): 4 by default, since
  on the linux backend each holds one of the kernel's NBD devices, 16 unless the nbd
  module is loaded with more, shared by every tenant. Enforced by the FunctionManager.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from dpu_agent.errors import ResourceExhausted

if TYPE_CHECKING:
    from dpu_agent.config import AgentConfig


@dataclasses.dataclass(frozen=True)
class Quotas:
    """Limits per tenant; 0 = none."""

    max_volumes: int = 0
    max_volume_bytes: int = 0
    max_snapshots: int = 0
    max_sessions: int = 0
    max_queue_depth: int = 0
    max_flow_rules: int = 0
    max_functions: int = 0
    max_block_functions: int = 0

    @classmethod
    def from_config(cls, config: AgentConfig) -> Quotas:
        """The [quota] section of the agent's configuration."""
        return cls(
            max_volumes=config.quota_max_volumes,
            max_volume_bytes=config.quota_max_volume_bytes,
            max_snapshots=config.quota_max_snapshots,
            max_sessions=config.quota_max_sessions,
            max_queue_depth=config.quota_max_queue_depth,
            max_flow_rules=config.quota_max_flow_rules,
            max_functions=config.quota_max_functions,
            max_block_functions=config.quota_max_block_functions,
        )

    def check_volumes(self, tenant: str, count: int, size_bytes: int) -> None:
        """`count` volumes of `size_bytes` in total would be within the tenant's quota."""
        _check(tenant, "max_volumes", self.max_volumes, count, "volumes")
        _check(tenant, "max_volume_bytes", self.max_volume_bytes, size_bytes, "bytes of volumes")

    def check_snapshots(self, tenant: str, count: int) -> None:
        """`count` snapshots would be within the tenant's quota."""
        _check(tenant, "max_snapshots", self.max_snapshots, count, "snapshots")

    def check_sessions(self, tenant: str, count: int, queue_depth: int) -> None:
        """`count` sessions with `queue_depth` jobs in flight in total would fit."""
        _check(tenant, "max_sessions", self.max_sessions, count, "sessions")
        _check(
            tenant,
            "max_queue_depth",
            self.max_queue_depth,
            queue_depth,
            "jobs in flight (the sum of its sessions' queue depths)",
        )

    def check_flow_rules(self, tenant: str, count: int) -> None:
        """`count` flow rules would fit."""
        _check(tenant, "max_flow_rules", self.max_flow_rules, count, "flow rules")

    def check_functions(self, tenant: str, count: int, blocks: int = 0) -> None:
        """`count` functions, `blocks` of them block functions, would fit."""
        _check(tenant, "max_functions", self.max_functions, count, "functions")
        _check(tenant, "max_block_functions", self.max_block_functions, blocks, "block functions")


def _check(tenant: str, key: str, limit: int, wanted: int, what: str) -> None:
    if limit and wanted > limit:
        raise ResourceExhausted(
            f"quota.{key}: tenant {tenant!r} would hold {wanted} {what}; its quota is {limit}"
        )
