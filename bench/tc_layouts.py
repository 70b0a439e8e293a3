"""Where forwarding time goes with many flower rules: the same 1000 rules in six layouts.

A study, not part of `make bench` (it takes minutes); run it in the test VM:

    python3 deploy/testvm/testvm.py run -- .venv/bin/python -m bench.tc_layouts [RUNS]

Every layout puts 1000 drop rules that no test packet matches (`dst_ip 10.99.x.y/32`
unless said otherwise) ahead of a match-all forward rule on rep1 (the topology of
tests/vm/network), installs them with one `tc -batch`, and measures TCP and 1400-byte
UDP h1 -> h2 as `bench.tc_rules` does, RUNS times (default 3):

| layout              | what the kernel holds on rep1's ingress                          |
|---------------------|------------------------------------------------------------------|
| alone               | the forward rule only (the reference)                            |
| pref-per-rule       | 1000 prefs, one flower instance and one mask each (main's layout) |
| one-pref-one-mask   | one pref holding all 1000 (one mask, one hash lookup)             |
| one-pref-ten-masks  | one pref, /23../32 prefixes: ten masks, 100 rules each            |
| ten-prefs           | ten prefs of 100 rules, one mask each                            |
| pref-per-rule-ipv6  | 1000 prefs of `protocol ipv6`: walked, but never classified       |
| other-chain         | 1000 prefs in chain 1, never reached (chain 0: the forward only)  |

It also times `tc -batch` installing the 1000 rules as one pref per rule and as one pref.

One smoke run (2026-11-23, RUNS=1, test VM under TCG on a loaded 2-CPU host: TCP
figures are noisy, UDP steadier), UDP MB/s as a fraction of `alone` (28.2):
pref-per-rule 0.04, one-pref-one-mask 0.91, one-pref-ten-masks 0.58, ten-prefs 0.65,
pref-per-rule-ipv6 0.71, other-chain 0.73. The cost is per flower instance (pref)
that classifies the packet, not per rule: rules sharing a mask in one pref cost
about one lookup. `tc -batch` installed 2,364 rules/s as prefs, 3,818 as one pref.
"""

from __future__ import annotations

import ipaddress
import statistics
import sys
import tempfile
import time
from typing import TYPE_CHECKING

from bench import common
from bench.tc_rules import tcp_mbps, udp_mbps
from dpu_agent.network.tc_backend import TcFlowBackend
from tests.vm.network.topology import DPU, build, sh, teardown

if TYPE_CHECKING:
    from collections.abc import Callable

RULES = 1000
FORWARD = "action mirred egress redirect dev {dst}"


def _address(n: int) -> str:
    return f"10.99.{n // 250}.{n % 250 + 1}"


def pref_per_rule(protocol: str = "ip", field: str = "dst_ip") -> list[str]:
    """One pref (one flower instance) per rule."""
    return [
        f"filter add dev rep1 ingress pref {n + 1} protocol {protocol} flower"
        f" {field} {_address(n) if protocol == 'ip' else f'2001:db8::{n + 1:x}'} action drop"
        for n in range(RULES)
    ]


def one_pref(masks: int) -> list[str]:
    """Every rule in pref 1, spread over `masks` prefix lengths."""
    lines = []
    for n in range(RULES):
        shift, index = n % masks, n // masks  # mask /(32 - shift), index-th network of it
        base = int(ipaddress.IPv4Address(f"10.{100 + shift}.0.0"))
        network = f"{ipaddress.IPv4Address(base + (index << shift))}/{32 - shift}"
        lines.append(
            f"filter add dev rep1 ingress pref 1 handle {n + 1} protocol ip flower"
            f" dst_ip {network} action drop"
        )
    return lines


def ten_prefs() -> list[str]:
    """Ten prefs of 100 rules."""
    return [
        f"filter add dev rep1 ingress pref {n // 100 + 1} handle {n + 1} protocol ip flower"
        f" dst_ip {_address(n)} action drop"
        for n in range(RULES)
    ]


def other_chain() -> list[str]:
    """One pref per rule in chain 1, which no packet reaches."""
    return [
        f"filter add dev rep1 ingress chain 1 pref {n + 1} protocol ip flower"
        f" dst_ip {_address(n)} action drop"
        for n in range(RULES)
    ]


LAYOUTS: dict[str, Callable[[], list[str]]] = {
    "alone": list,
    "pref-per-rule": pref_per_rule,
    "one-pref-one-mask": lambda: one_pref(1),
    "one-pref-ten-masks": lambda: one_pref(10),
    "ten-prefs": ten_prefs,
    "pref-per-rule-ipv6": lambda: pref_per_rule("ipv6", "dst_ip"),
    "other-chain": other_chain,
}


def batch(lines: list[str]) -> float:
    """Run the lines with one `tc -batch`; seconds it took."""
    with tempfile.NamedTemporaryFile("w", suffix=".tc") as f:
        f.write("\n".join(lines) + "\n")
        f.flush()
        start = time.perf_counter()
        sh("tc", "-n", DPU, "-batch", f.name)
        return time.perf_counter() - start


def layout(name: str) -> None:
    """Replace rep1's ingress filters by layout `name` and the forward rule."""
    sh("tc", "-n", DPU, "filter", "del", "dev", "rep1", "ingress")
    lines = LAYOUTS[name]()
    lines.append(
        "filter add dev rep1 ingress pref 30000 protocol all flower " + FORWARD.format(dst="rep2")
    )
    batch(lines)


def main() -> None:
    """Build the topology, time the installs, measure every layout."""
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    try:
        build()
        for rep in ("rep1", "rep2"):
            sh("tc", "-n", DPU, "qdisc", "add", "dev", rep, "clsact")
        sh(
            *("tc", "-n", DPU, "filter", "add", "dev", "rep2", "ingress", "pref", "1"),
            *("protocol", "all", "flower", *FORWARD.format(dst="rep1").split()),
        )
        for name, lines in (("pref per rule", pref_per_rule()), ("one pref", one_pref(1))):
            times = []
            for _ in range(runs):
                sh("tc", "-n", DPU, "filter", "del", "dev", "rep1", "ingress")
                times.append(RULES / batch(lines))
            print(f"tc -batch install, {name}: {_spread(times)} rules/s", flush=True)
        with TcFlowBackend(("rep*",), netns=DPU) as backend:
            for name in LAYOUTS:
                layout(name)
                tcp, udp = [], []
                for _ in range(runs):
                    tcp.append(tcp_mbps())
                    udp.append(udp_mbps(backend))
                print(f"{name:<20} TCP {_spread(tcp)} MB/s  UDP {_spread(udp)} MB/s", flush=True)
    finally:
        teardown()


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):7.1f} ({min(values):.1f}-{max(values):.1f})"


if __name__ == "__main__":
    common.command_line(__doc__)
    main()
