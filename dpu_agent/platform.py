"""What the agent can learn about the machine it runs on: platform and RDMA devices.

pyverbs is optional: on a machine without it, or without an RDMA device, the
agent runs with no verbs transport and says so in its capabilities.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

log = logging.getLogger(__name__)

_DMI_PRODUCT = Path("/sys/class/dmi/id/product_name")


@dataclasses.dataclass(frozen=True)
class RdmaPortInfo:
    """State of one port of an RDMA device."""

    port_num: int
    state: str
    active_mtu: int
    link_layer: str


@dataclasses.dataclass(frozen=True)
class RdmaDeviceInfo:
    """An RDMA device and its ports."""

    name: str
    node_guid: str
    ports: tuple[RdmaPortInfo, ...]


def platform_kind() -> str:
    """`bluefield` on a BlueField DPU's Arm Linux, else `linux`."""
    try:
        product = _DMI_PRODUCT.read_text(encoding="ascii", errors="replace")
    except OSError:
        return "linux"
    return "bluefield" if "bluefield" in product.lower() else "linux"


_PORT_STATES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
_MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}
_LINK_LAYERS = {0: "Unspecified", 1: "InfiniBand", 2: "Ethernet"}


def rdma_devices() -> tuple[RdmaDeviceInfo, ...]:
    """RDMA devices visible through libibverbs; empty when there are none."""
    # The verbs transport imports pyverbs with the root logger protected (pyverbs calls
    # logging.basicConfig on import); import it that way first.
    from dpu_wire.transport import verbs  # noqa: PLC0415, F401

    try:
        from pyverbs import device  # noqa: PLC0415 - optional dependency
        from pyverbs.pyverbs_error import PyverbsError  # noqa: PLC0415
    except ImportError:
        log.info("pyverbs not importable: no verbs transport")
        return ()
    try:
        found = device.get_device_list()
    except PyverbsError:
        return ()
    result = []
    for dev in found:
        name = dev.name.decode()
        try:
            with device.Context(name=name) as ctx:
                attr = ctx.query_device()
                ports = []
                for num in range(1, attr.phys_port_cnt + 1):
                    pattr = ctx.query_port(num)
                    ports.append(
                        RdmaPortInfo(
                            port_num=num,
                            state=_PORT_STATES.get(pattr.state, str(pattr.state)),
                            active_mtu=_MTU_BYTES.get(pattr.active_mtu, 0),
                            link_layer=_LINK_LAYERS.get(pattr.link_layer, str(pattr.link_layer)),
                        )
                    )
        except PyverbsError as exc:
            log.warning("cannot query RDMA device", extra={"device": name, "error": str(exc)})
            continue
        result.append(
            RdmaDeviceInfo(
                name,
                f"{dev.guid:016x}" if isinstance(dev.guid, int) else str(dev.guid),
                tuple(ports),
            )
        )
    return tuple(result)
