"""The VLAN ids and VNIs granted to each tenant: `[network] tenant_tags_file`.

A VLAN id or VXLAN VNI is a segment the operator gives to one tenant (or, on
purpose, to several). Which tags a tenant's flow rules may push, pop, encapsulate,
decapsulate and match, and what they may send to an uplink, is
`dpu_agent.network.access`'s rule; this module reads the grants. The file is TOML,
one table per tenant, ids alone or as "low-high" ranges:

    [tenant.tenant-a]
    vlans = [100, "200-299"]      # 802.1Q VLAN ids, 1..4094
    vnis = ["5000-5099"]          # VXLAN network identifiers, 0..16777215

    [tenant.tenant-b]
    vlans = [300]
    untagged = true               # may send frames to an uplink in no granted VLAN

`untagged` (default false) lets the tenant's rules forward and mirror to an uplink
(`p0`, `p1`) frames they do not put in one of its VLANs: untagged, or as the function
tagged them. Without it such a rule must push a granted VLAN id, or match one and
keep it. It is for an uplink one tenant has to itself, or whose tenants the operator
trusts (or keeps apart by the functions' own VLANs, which only an admin sets).

A tenant not listed, and every tenant when no file is set, is granted nothing. The
admin role needs no grant. The file is read when the agent starts (and by
`dpu-agent check-config`); a malformed one is a ConfigError naming the entry, and
one that group or others may write is refused (whoever writes it can cross tenants).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import TYPE_CHECKING, Final

from dpu_agent.config import ConfigError
from dpu_agent.private_files import read_toml
from dpu_wire import names

if TYPE_CHECKING:
    from collections.abc import Mapping

    from dpu_agent.config import AgentConfig

MAX_FILE_BYTES: Final = 1 << 20
MAX_ITEMS: Final = 1024  # entries in one vlans or vnis list (ranges make this plenty)
#: key -> (lowest, highest) id a grant may name, both included.
BOUNDS: Final = {"vlans": (1, 4094), "vnis": (0, (1 << 24) - 1)}
KEYS: Final = (*BOUNDS, "untagged")  # the keys of a tenant's table
_RANGE: Final = re.compile(r"\s*([0-9]{1,10})\s*(?:-\s*([0-9]{1,10})\s*)?")


@dataclasses.dataclass(frozen=True)
class Ranges:
    """A set of ids as inclusive (low, high) spans."""

    spans: tuple[tuple[int, int], ...] = ()

    def __contains__(self, value: object) -> bool:
        """Whether `value` is in one of the spans."""
        return isinstance(value, int) and any(lo <= value <= hi for lo, hi in self.spans)

    def __str__(self) -> str:
        """The ids as text: "100, 200-299", or "none"."""
        text = [str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in self.spans]
        return ", ".join(text) or "none"


@dataclasses.dataclass(frozen=True)
class TagGrant:
    """The VLAN ids and VNIs of one tenant, and whether it may send untagged to an uplink."""

    vlans: Ranges = Ranges()
    vnis: Ranges = Ranges()
    untagged: bool = False


NOTHING: Final = TagGrant()


@dataclasses.dataclass(frozen=True)
class TenantTags:
    """Tenant -> its grant; a tenant not in `grants` has none."""

    grants: Mapping[str, TagGrant] = dataclasses.field(default_factory=dict)

    def of(self, tenant: str) -> TagGrant:
        """The tenant's grant (nothing if it has none)."""
        return self.grants.get(tenant, NOTHING)


def from_config(config: AgentConfig) -> TenantTags:
    """The grants of `[network] tenant_tags_file`; none when it is not set."""
    if not config.network_tenant_tags_file:
        return TenantTags()
    try:
        return load(Path(config.network_tenant_tags_file).expanduser())
    except ConfigError as exc:
        raise ConfigError(f"network.tenant_tags_file: {exc}") from None


def load(path: Path) -> TenantTags:
    """Read a tenant tags file (the module docstring); ConfigError says what is wrong."""
    return parse(read_toml(path, MAX_FILE_BYTES, ConfigError, secret=False), str(path))


def parse(doc: Mapping[str, object], where: str) -> TenantTags:
    """The grants of a parsed tags document; ConfigError naming `where` and the entry."""
    unknown = set(doc) - {"tenant"}
    if unknown:
        raise ConfigError(f"{where}: unknown key {min(unknown)!r} (expected [tenant.<name>])")
    tenants = doc.get("tenant", {})
    if not isinstance(tenants, dict):
        raise ConfigError(f"{where}: tenant must be a table of [tenant.<name>] tables")
    grants = {}
    for tenant, entry in tenants.items():
        at = f"{where}: tenant.{tenant}"
        try:
            names.check_id(tenant, "tenant")
        except names.InvalidNameError as exc:
            raise ConfigError(f"{at}: {exc}") from None
        if not isinstance(entry, dict):
            raise ConfigError(f"{at}: must be a table ({', '.join(KEYS)})")
        unknown = set(entry) - set(KEYS)
        if unknown:
            raise ConfigError(f"{at}: unknown key {min(unknown)!r} (expected {', '.join(KEYS)})")
        untagged = entry.get("untagged", False)
        if not isinstance(untagged, bool):
            raise ConfigError(f"{at}.untagged: expected true or false, got {untagged!r}")
        grants[tenant] = TagGrant(
            vlans=_ranges(entry.get("vlans", []), f"{at}.vlans", BOUNDS["vlans"]),
            vnis=_ranges(entry.get("vnis", []), f"{at}.vnis", BOUNDS["vnis"]),
            untagged=untagged,
        )
    return TenantTags(grants)


def _ranges(items: object, where: str, bounds: tuple[int, int]) -> Ranges:
    if not isinstance(items, list) or len(items) > MAX_ITEMS:
        raise ConfigError(f"{where}: expected a list of at most {MAX_ITEMS} ids or ranges")
    spans = [_span(item, f"{where}[{index}]", bounds) for index, item in enumerate(items)]
    return Ranges(tuple(sorted(set(spans))))


def _span(item: object, where: str, bounds: tuple[int, int]) -> tuple[int, int]:
    low, high = bounds
    expected = f'an id or a range "low-high" in {low}..{high}'
    if isinstance(item, int) and not isinstance(item, bool):
        first = last = item
    elif isinstance(item, str):
        found = _RANGE.fullmatch(item)
        if found is None:
            raise ConfigError(f"{where}: {item!r} is not {expected}")
        first = int(found[1])
        last = int(found[2]) if found[2] is not None else first
    else:
        raise ConfigError(f"{where}: expected {expected}, got {item!r}")
    if not low <= first <= last <= high:
        raise ConfigError(f"{where}: {item!r} is not {expected}")
    return first, last
