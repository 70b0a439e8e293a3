"""Network functions on plain Linux: a veth pair per function, driven with `ip` and `tc`.

A function is a veth pair. The representor end (`pf0vf<N>`, or `pf0sf<N>` for a
scalable function) stays on the DPU side, in the network service's namespace, where
flow rules act on it; it carries the alias `dpu-function:<id>` so it can be found
again. The function end is `eth0` in a namespace of its own (`<prefix><id>`, standing
for the host or the guest the function is handed to).

What SR-IOV would enforce in the NIC for a VF is enforced with tc on the function
end, outside the representor's rules:

- egress (what the function sends), one filter at pref 10: with spoof check, flower
  `src_mac <the function's MAC>` (and a matchall drop at pref 20 for the rest),
  without it a matchall; its actions: `police rate <rate_limit>bit burst <20 ms>
  conform-exceed drop/pipe` when a rate limit is set, `vlan push id <vlan>` when a
  VLAN is set, else `pass`;
- ingress (what the function receives), only with a VLAN: flower `vlan_id <vlan>`
  then `vlan pop` at pref 10, matchall drop at pref 20, so the function sees its own
  VLAN untagged and nothing else (VST, as `ip link set <pf> vf N vlan V` does).

`trust` is recorded; this backend has no MAC-change or promiscuous policy to apply.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import TYPE_CHECKING, Final

from dpu_agent.errors import FailedPrecondition, InvalidArgument
from dpu_agent.virtualization.commands import CommandFailed
from dpu_agent.virtualization.model import FunctionType

if TYPE_CHECKING:
    from dpu_agent.virtualization.commands import Runner
    from dpu_agent.virtualization.model import FunctionSpec
    from dpu_agent.virtualization.undo import Undo

ALIAS_PREFIX: Final = "dpu-function:"
FUNCTION_IFNAME: Final = "eth0"
MAX_NETNS_NAME: Final = 200
BURST_SECONDS: Final = 0.02
MIN_BURST_BYTES: Final = 16 * 1024
_GONE: Final = re.compile(
    r"cannot find|does not exist|no such|not found|invalid handle", re.IGNORECASE
)


def derived_mac(function_id: str) -> str:
    """A stable locally administered unicast MAC for a function that was given none."""
    digest = hashlib.sha256(function_id.encode()).digest()
    return ":".join(f"{b:02x}" for b in (0x02, *digest[:5]))


def police_burst(rate_bps: int, mtu: int) -> int:
    """Bucket size: 20 ms at the rate, at least 16 KiB and a few frames."""
    return max(int(rate_bps / 8 * BURST_SECONDS), MIN_BURST_BYTES, 4 * (mtu + 18))


def controls(spec: FunctionSpec, mac: str) -> list[str]:
    """The `tc -batch` lines that put a function's controls on its end (none: [])."""
    actions = ""
    if spec.rate_limit_bps:
        burst = police_burst(spec.rate_limit_bps, spec.mtu)
        actions += (
            f" action police rate {spec.rate_limit_bps}bit burst {burst} conform-exceed drop/pipe"
        )
    if spec.vlan_id is not None:
        actions += f" action vlan push id {spec.vlan_id}"
    if not (actions or spec.spoof_check):
        return []
    dev = f"dev {FUNCTION_IFNAME}"
    lines = [f"qdisc add {dev} clsact"]
    if spec.spoof_check:
        lines += [
            f"filter add {dev} egress pref 10 protocol all flower src_mac {mac}"
            + (actions or " action pass"),
            f"filter add {dev} egress pref 20 protocol all matchall action drop",
        ]
    else:
        lines.append(f"filter add {dev} egress pref 10 protocol all matchall{actions}")
    if spec.vlan_id is not None:
        lines += [
            (
                f"filter add {dev} ingress pref 10 protocol 802.1Q flower vlan_id {spec.vlan_id}"
                " action vlan pop"
            ),
            f"filter add {dev} ingress pref 20 protocol all matchall action drop",
        ]
    return lines


class LinuxNet:
    """The `ip`/`tc` steps of a network function; the backend strings them together."""

    def __init__(self, runner: Runner, dpu_netns: str, host_netns_prefix: str) -> None:
        self.run = runner
        self.dpu_netns = dpu_netns
        self.prefix = host_netns_prefix

    # ------------------------------------------------------------------ names
    def netns(self, function_id: str) -> str:
        """The namespace standing for the function's host or guest."""
        name = f"{self.prefix}{function_id}"
        if len(name) > MAX_NETNS_NAME or "/" in name:
            raise InvalidArgument(f"function id {function_id!r} makes a bad namespace name")
        return name

    def _ip(self, *args: str) -> list[str]:
        return ["ip", "-n", self.dpu_netns, *args] if self.dpu_netns else ["ip", *args]

    def links(self) -> list[dict[str, object]]:
        """The DPU side's links as `ip -j link show` reports them."""
        data = json.loads(self.run(self._ip("-j", "link", "show")) or "[]")
        return data if isinstance(data, list) else []

    def namespaces(self) -> set[str]:
        """Names of the named network namespaces."""
        data = json.loads(self.run(["ip", "-j", "netns", "list"]) or "[]")
        return {str(item["name"]) for item in data if isinstance(item, dict) and "name" in item}

    def representors_of(self, function_id: str) -> list[str]:
        """The DPU-side links marked as this function's (normally one)."""
        alias = ALIAS_PREFIX + function_id
        return [str(link["ifname"]) for link in self.links() if link.get("ifalias") == alias]

    def free_representor(self, spec: FunctionSpec) -> str:
        """The first unused `pf0vf<N>` (`pf0sf<N>` for a scalable function)."""
        prefix = "pf0sf" if spec.type is FunctionType.SF else "pf0vf"
        used = {str(link.get("ifname")) for link in self.links()}
        index = 0
        while f"{prefix}{index}" in used:
            index += 1
        return f"{prefix}{index}"

    # ------------------------------------------------------------------ steps
    def create(self, spec: FunctionSpec, undo: Undo) -> tuple[str, str, str]:
        """Make the pair, name, address and police it; return (representor, netns, MAC)."""
        ns = self.netns(spec.function_id)
        if ns in self.namespaces():
            raise FailedPrecondition(f"network namespace {ns} already exists")
        rep = self.free_representor(spec)
        mac = spec.mac or derived_mac(spec.function_id)
        self.run(["ip", "netns", "add", ns])
        undo.push(f"netns {ns}", lambda: self.run(["ip", "netns", "del", ns]))
        self.run(self._ip("link", "add", rep, "type", "veth", "peer", "name", FUNCTION_IFNAME,
                          "netns", ns))  # fmt: skip
        undo.push(f"link {rep}", lambda: self.run(self._ip("link", "del", rep)))
        alias = ALIAS_PREFIX + spec.function_id
        self.run(self._ip("link", "set", rep, "alias", alias, "mtu", str(spec.mtu), "up"))
        self.run(["ip", "-n", ns, "link", "set", FUNCTION_IFNAME, "address", mac,
                  "mtu", str(spec.mtu), "up"])  # fmt: skip
        self.run(["ip", "-n", ns, "link", "set", "lo", "up"])
        self.apply_controls(ns, spec, mac)
        return rep, ns, mac

    def apply_controls(self, ns: str, spec: FunctionSpec, mac: str) -> None:
        """The function's VLAN, rate limit and spoof check as tc filters on its end.

        One `tc -batch` run: the qdisc and every filter in one process, all or nothing
        (tc stops at the first failing line; `clear_controls` removes what came before).
        """
        lines = controls(spec, mac)
        if lines:
            self.run(["tc", "-n", ns, "-batch", "-"], input_text="".join(f"{x}\n" for x in lines))

    def clear_controls(self, ns: str) -> None:
        """Remove the function end's tc filters (its clsact qdisc)."""
        self.ignore_gone(["tc", "-n", ns, "qdisc", "del", "dev", FUNCTION_IFNAME, "clsact"])

    def set_link(self, rep: str, ns: str, spec: FunctionSpec, mac: str) -> None:
        """MTU on both ends and the function end's MAC."""
        self.run(self._ip("link", "set", rep, "mtu", str(spec.mtu)))
        self.run(["ip", "-n", ns, "link", "set", FUNCTION_IFNAME, "address", mac,
                  "mtu", str(spec.mtu)])  # fmt: skip

    def delete(self, function_id: str, rep: str) -> None:
        """Remove the pair (representor first: a namespace dies asynchronously) and the netns."""
        for name in {rep, *self.representors_of(function_id)} - {""}:
            self.ignore_gone(self._ip("link", "del", name))
        ns = self.netns(function_id)
        if ns in self.namespaces():
            self.run(["ip", "netns", "del", ns])

    def present(self, function_id: str, rep: str) -> bool:
        """Whether the namespace and the marked representor both exist."""
        return self.netns(function_id) in self.namespaces() and rep in self.representors_of(
            function_id
        )

    def ignore_gone(self, argv: list[str]) -> None:
        """Run a removal; "it is not there" is success."""
        try:
            self.run(argv)
        except CommandFailed as exc:
            if not _GONE.search(exc.stderr):
                raise
