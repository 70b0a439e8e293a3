"""Functions as the agent understands them, independent of any backend."""

from __future__ import annotations

import dataclasses
import enum
import re
from typing import Final

from dpu_agent.errors import InvalidArgument

MIN_MTU: Final = 68
MAX_MTU: Final = 9216
DEFAULT_MTU: Final = 1500
MAX_VLAN_ID: Final = 4094
MIN_RATE_BPS: Final = 8_000  # 1 kB/s; below that a token bucket is meaningless
MAX_RATE_BPS: Final = 400_000_000_000  # 400 Gbit/s, the fastest BlueField port
MUTABLE_FIELDS: Final = frozenset(
    {"mac", "mtu", "vlan_id", "rate_limit_bps", "trust", "spoof_check"}
)
_MAC: Final = re.compile(r"^[0-9a-f]{2}(:[0-9a-f]{2}){5}$")


class FunctionType(enum.StrEnum):
    """What the host sees."""

    VF = "vf"  # SR-IOV virtual function (a netdev)
    SF = "sf"  # scalable function (a netdev)
    VIRTIO_NET = "virtio-net"  # emulated virtio-net device (a netdev)
    VIRTIO_BLK = "virtio-blk"  # emulated virtio-blk device (a block device)
    NVME = "nvme"  # emulated NVMe controller (a block device)

    @property
    def is_block(self) -> bool:
        """True for the functions that expose a volume."""
        return self in {FunctionType.VIRTIO_BLK, FunctionType.NVME}


class FunctionState(enum.StrEnum):
    """Where a function is in its life."""

    CREATING = "creating"
    READY = "ready"
    DELETING = "deleting"
    FAILED = "failed"


@dataclasses.dataclass(frozen=True)
class FunctionSpec:
    """What the caller asked for. `UpdateFunction` may change the `MUTABLE_FIELDS`."""

    function_id: str
    type: FunctionType
    tenant: str = "default"
    mac: str = ""  # "" = the backend picks one
    mtu: int = DEFAULT_MTU
    vlan_id: int | None = None  # the function's traffic is tagged with it on the DPU side
    rate_limit_bps: int = 0  # 0 = unlimited; caps what the function sends
    trust: bool = False
    spoof_check: bool = True
    volume_id: str = ""  # block functions only

    def __post_init__(self) -> None:
        check_spec(self)


@dataclasses.dataclass(frozen=True)
class Provisioned:
    """What a backend made for a function.

    `representor_port` is the DPU-side port (a netdev the network service manages),
    `host_device` what the host sees, as far as the DPU can tell: the linux backend's
    "<netns>/eth0" or /dev path, the bluefield backend's "vf:<pf>/<vf>", "sf:<pf>/<sf>"
    or "pci:<bdf>" (the host's own names are not visible from the DPU), and `facts`
    whatever the backend needs to find and tear the function down later (namespace,
    NQN, device numbers...), persisted with the record. Strings only.
    """

    representor_port: str
    host_device: str
    facts: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class FunctionRecord:
    """A function the agent manages: the spec, what was made, and its state."""

    spec: FunctionSpec
    provisioned: Provisioned | None
    state: FunctionState
    created_ns: int
    updated_ns: int


def normalize_mac(text: str, what: str = "mac_address") -> str:
    """Lower-case colon form; "" stays "". InvalidArgument if it is not a unicast MAC."""
    if not text:
        return ""
    mac = text.strip().lower().replace("-", ":")
    if not _MAC.match(mac):
        raise InvalidArgument(f"{what}: {text!r} is not a MAC address (aa:bb:cc:dd:ee:ff)")
    if int(mac[:2], 16) & 1:
        raise InvalidArgument(f"{what}: {text!r} is a multicast address")
    if mac == "00:00:00:00:00:00":
        raise InvalidArgument(f"{what}: the all-zero address is not a station address")
    return mac


def check_spec(spec: FunctionSpec) -> None:
    """InvalidArgument naming the first field that is out of range."""
    if spec.mac and normalize_mac(spec.mac) != spec.mac:
        raise InvalidArgument(f"mac_address: {spec.mac!r} is not in normal form")
    if not MIN_MTU <= spec.mtu <= MAX_MTU:
        raise InvalidArgument(f"mtu: {spec.mtu} is outside {MIN_MTU}..{MAX_MTU}")
    if spec.vlan_id is not None and not 1 <= spec.vlan_id <= MAX_VLAN_ID:
        raise InvalidArgument(f"vlan_id: {spec.vlan_id} is outside 1..{MAX_VLAN_ID}")
    if spec.rate_limit_bps and not MIN_RATE_BPS <= spec.rate_limit_bps <= MAX_RATE_BPS:
        raise InvalidArgument(
            f"rate_limit_bps: {spec.rate_limit_bps} is outside {MIN_RATE_BPS}..{MAX_RATE_BPS}"
            " (0 = unlimited)"
        )
    if spec.type.is_block:
        if not spec.volume_id:
            raise InvalidArgument(f"volume: a {spec.type} function needs a volume")
        if spec.vlan_id is not None or spec.rate_limit_bps or spec.mac:
            raise InvalidArgument(
                f"a {spec.type} function has no network settings (mac, vlan, rate limit)"
            )
    elif spec.volume_id:
        raise InvalidArgument(f"volume: a {spec.type} function is not a block function")
