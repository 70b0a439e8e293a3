"""Who is calling, and what they may see. Services call this; they never look at TLS.

The interceptor works out a `Principal` for every RPC (`dpu_agent.identity`: the
client certificate, a bearer token on plaintext loopback, or the local admin) and
puts it in a context variable; `current_principal()` reads it back.

Ownership. Every tenant-owned resource records its tenant: sessions (and so their
regions, keys, attached volumes and jobs), volumes (in the volume store's catalog)
and flow rules (in the rule store). A principal sees a resource when it owns it or
holds the admin role. A resource it may not see answers NOT_FOUND with the very
message a resource that does not exist gets, so a tenant cannot learn the names of
another tenant's resources by probing. (Resource ids are agent-wide: creating an id
another tenant already uses answers ALREADY_EXISTS, the one answer that tells an id
is taken.) New resources belong to the caller's tenant, admins included.

Admin role: agent-wide operations (the ports, flow rules on uplink ports) need it,
and an admin sees and manages every tenant's resources. Quotas (`dpu_agent.quota`)
bind admins like everyone else.

In a service:

    owner = auth.tenant()                                   # who a new resource belongs to
    auth.check_owner(rule.tenant, f"flowRules/{rule_id}")   # NotFound unless visible
    visible = [r for r in rules if auth.can_see(r.tenant)]  # list filters
    auth.require_admin("listing ports")                     # PermissionDenied otherwise
"""

from __future__ import annotations

import contextvars
import dataclasses
import enum
from typing import Final

from dpu_agent.errors import NotFound, PermissionDenied, Unauthenticated

DEFAULT_TENANT: Final = "default"
"""The tenant of the local admin, and of volumes and rules saved before tenants existed."""

ADMIN_ROLE: Final = "admin"
"""The role name: a client certificate's subject O (organization), a token's `admin`."""


class Via(enum.StrEnum):
    """How the principal proved who it is."""

    CERTIFICATE = "certificate"  # mTLS client certificate
    TOKEN = "token"  # noqa: S105 - names a kind of credential: a bearer token (loopback only)
    LOOPBACK = "loopback"  # plaintext loopback without tokens: the local admin


@dataclasses.dataclass(frozen=True)
class Principal:
    """The caller of an RPC: its tenant and whether it holds the admin role."""

    tenant: str
    admin: bool = False
    via: Via = Via.CERTIFICATE

    def can_see(self, owner: str) -> bool:
        """Whether a resource of tenant `owner` is visible to this principal."""
        return self.admin or owner == self.tenant


principal: contextvars.ContextVar[Principal | None] = contextvars.ContextVar(
    "principal", default=None
)
"""Who makes the RPC being served: set by the interceptor, read by `current_principal`."""

LOCAL_ADMIN: Final = Principal(DEFAULT_TENANT, admin=True, via=Via.LOOPBACK)
"""Every caller of a plaintext loopback agent that has no tokens file."""


def current_principal() -> Principal:
    """The principal of the RPC being served; Unauthenticated outside an RPC."""
    found = principal.get()
    if found is None:
        raise Unauthenticated("the call carries no credentials")
    return found


def tenant() -> str:
    """The caller's tenant: the owner of anything it creates."""
    return current_principal().tenant


def caller_tenant() -> str:
    """The tenant of the RPC being served, "" outside one (no principal)."""
    found = principal.get()
    return "" if found is None else found.tenant


def can_see(owner: str) -> bool:
    """Whether the caller may see a resource owned by tenant `owner`."""
    return current_principal().can_see(owner)


def check_owner(owner: str, what: str) -> None:
    """NotFound ("{what} does not exist") unless the caller may see the resource.

    Give `what` exactly as the not-found message of a missing resource names it, so
    the two answers cannot be told apart.
    """
    if not can_see(owner):
        raise NotFound(f"{what} does not exist")


def require_admin(what: str) -> Principal:
    """The caller, if it holds the admin role; PermissionDenied naming `what` otherwise."""
    principal = current_principal()
    if not principal.admin:
        raise PermissionDenied(f"{what} needs the {ADMIN_ROLE} role")
    return principal
