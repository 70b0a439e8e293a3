"""tc flower rules: TcFlowBackend vs the tc tool, and what 1000 rules cost forwarding.

Needs tc flower (cls_flower), so where it is not usable `make bench` runs this in the
test VM (the same topology as tests/vm/network: h1, h2, h3 behind rep1, rep2, rep3 in
netns dpu, no bridge):

    python3 deploy/testvm/testvm.py run -- .venv/bin/python -m bench.tc_rules

- install rate: 1000 flower drop rules (dst IP /32 each, action cookie, one
  priority each) through one `TcFlowBackend.apply` (the bulk call behind
  ApplyFlowRules: compile, one dump per port, one netlink batch), and through
  `TcFlowBackend.install`, one call per rule, on rep1, each vs the same 1000
  filters on rep3 with one `tc -batch` (its process start included) right after;
  the bulk pair five times, interleaved, each side's median;
- forwarding: TCP h1 -> h2 for 2 s (64 KiB sends) and a UDP flood of 1400-byte
  datagrams (bytes rep2 sent on to h2) through forward rules, with the 1000
  non-matching rules at higher priority on rep1 vs the forward rules alone. Each
  rule has its own priority, so every packet walks 1000 flower instances.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import statistics
import tempfile
import threading
import time

from bench import common
from bench.common import Result
from dpu_agent.network.model import Drop, FlowMatch, FlowRule, Forward
from dpu_agent.network.tc_backend import COOKIE_MAGIC, TcFlowBackend, rule_cookie
from tests.vm.network.topology import (
    DPU,
    HOSTS,
    build,
    flower_unusable,
    ns_socket,
    sh,
    teardown,
)

NAME = "tc_rules"
RULES = 1000
SECONDS = 2.0
BULK_ROUNDS = common.quick(5, 1)  # interleaved (ours, tc -batch) pairs of the bulk install
FORWARD_PRIORITY = RULES + 1000
TCP_PORT = 5201
UDP_PORT = 5202
UDP_PAYLOAD = 1400
MB = 1e6


def bench_rules(port: str) -> list[FlowRule]:
    """RULES drop rules on `port`, priorities 1..RULES, none matching 10.10.0.0/24."""
    return [
        FlowRule(
            f"bench-{n}",
            n + 1,
            port,
            FlowMatch(dst_ip=ipaddress.ip_network(f"10.99.{n // 250}.{n % 250 + 1}/32")),
            (Drop(),),
        )
        for n in range(RULES)
    ]


def tc_batch_line(rule: FlowRule, port: str) -> str:
    """The `tc -batch` line of the filter `TcFlowBackend.install` makes for a bench rule."""
    return (
        f"filter add dev {port} ingress pref {rule.priority} protocol ip flower"
        f" dst_ip {rule.match.dst_ip} action gact drop cookie {rule_cookie(rule.rule_id).hex()}\n"
    )


def install_rates(backend: TcFlowBackend, *, bulk: bool) -> tuple[float, float]:
    """(ours, tc -batch) in rules per second, RULES rules each on its own port.

    Ours is one bulk `apply` or one `install` per rule, on rep1; tc's the same filters
    on rep3 right after. A bulk install is measured in BULK_ROUNDS such pairs (its rules
    removed through the backend in between) and each side's median taken: the VM's
    speed drifts by tens of percent within a minute, and interleaving keeps both sides
    in the same moments. The last round's rules stay on rep1.
    """
    for port in ("rep1", "rep3"):
        sh("tc", "-n", DPU, "qdisc", "replace", "dev", port, "clsact")
    sh("tc", "-n", DPU, "filter", "del", "dev", "rep1", "ingress")
    ours_rates, tc_rates = [], []
    rounds = BULK_ROUNDS if bulk else 1
    for round_ in range(rounds):
        ours = bench_rules("rep1")
        start = time.perf_counter()
        if bulk:
            backend.apply([], ours)
        else:
            for rule in ours:
                backend.install(rule)
        ours_rates.append(RULES / (time.perf_counter() - start))
        with tempfile.NamedTemporaryFile("w", suffix=".tc") as batch:
            batch.writelines(tc_batch_line(rule, "rep3") for rule in bench_rules("rep3"))
            batch.flush()
            start = time.perf_counter()
            sh("tc", "-n", DPU, "-batch", batch.name)
            tc_rates.append(RULES / (time.perf_counter() - start))
        if count_ours("rep1") != RULES or count_ours("rep3") != RULES:
            raise RuntimeError(f"rep1 and rep3 should have {RULES} filters each")
        sh("tc", "-n", DPU, "filter", "del", "dev", "rep3", "ingress")
        if round_ < rounds - 1:
            backend.apply(ours, [])
    return statistics.median(ours_rates), statistics.median(tc_rates)


def tcp_mbps() -> float:
    """MB/s one TCP connection h1 -> h2 delivers in SECONDS."""
    received = [0]
    chunk = bytes(64 << 10)
    with ns_socket("h2", socket.AF_INET, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((HOSTS["h2"], TCP_PORT))
        server.listen(1)

        def receive() -> None:
            conn, _ = server.accept()
            buf = memoryview(bytearray(1 << 20))
            with conn:
                while n := conn.recv_into(buf):
                    received[0] += n

        thread = threading.Thread(target=receive)
        thread.start()
        with ns_socket("h1", socket.AF_INET, socket.SOCK_STREAM) as client:
            client.connect((HOSTS["h2"], TCP_PORT))
            start = time.perf_counter()
            while time.perf_counter() - start < SECONDS:
                client.sendall(chunk)
        thread.join()
        return received[0] / (time.perf_counter() - start) / MB


def udp_mbps(backend: TcFlowBackend) -> float:
    """MB/s of UDP payload-carrying frames rep2 sends on to h2 during a SECONDS flood."""
    payload = bytes(UDP_PAYLOAD)

    def rep2_tx() -> int:
        return next(p.counters.tx_bytes for p in backend.ports() if p.name == "rep2")

    with (
        ns_socket("h2", socket.AF_INET, socket.SOCK_DGRAM) as sink,
        ns_socket("h1", socket.AF_INET, socket.SOCK_DGRAM) as sender,
    ):
        sink.bind((HOSTS["h2"], UDP_PORT))
        before = rep2_tx()
        start = time.perf_counter()
        while (elapsed := time.perf_counter() - start) < SECONDS:
            with contextlib.suppress(OSError):
                sender.sendto(payload, (HOSTS["h2"], UDP_PORT))
        time.sleep(0.2)
        return (rep2_tx() - before) / elapsed / MB


def count_ours(port: str) -> int:
    """How many filters with a dpu1 cookie `tc filter show` lists on a port's ingress."""
    listed = sh("tc", "-n", DPU, "filter", "show", "dev", port, "ingress").stdout
    return listed.count("cookie " + COOKIE_MAGIC.hex())


def forwarding(backend: TcFlowBackend) -> tuple[tuple[float, float], tuple[float, float]]:
    """((TCP, UDP) MB/s with RULES rules ahead, (TCP, UDP) with none), best of two each."""
    forward = (
        FlowRule("fwd-1-2", FORWARD_PRIORITY, "rep1", FlowMatch(), (Forward("rep2"),)),
        FlowRule("fwd-2-1", FORWARD_PRIORITY, "rep2", FlowMatch(), (Forward("rep1"),)),
    )
    for rule in forward:
        backend.install(rule)
    loaded: list[tuple[float, float]] = []
    bare: list[tuple[float, float]] = []
    for again in (False, True):
        if again:
            sh("tc", "-n", DPU, "filter", "del", "dev", "rep1", "ingress")
            for rule in (*bench_rules("rep1"), forward[0]):
                backend.install(rule)
        if count_ours("rep1") != RULES + 1:
            raise RuntimeError(f"rep1 should have {RULES} + 1 filters")
        loaded.append((tcp_mbps(), udp_mbps(backend)))
        sh("tc", "-n", DPU, "filter", "del", "dev", "rep1", "ingress")
        backend.install(forward[0])
        bare.append((tcp_mbps(), udp_mbps(backend)))
    best = (max(t for t, _ in loaded), max(u for _, u in loaded))
    return best, (max(t for t, _ in bare), max(u for _, u in bare))


def measure() -> list[Result]:
    """Build the topology, measure, tear it down."""
    try:
        build()
        with TcFlowBackend(("rep*",), netns=DPU) as backend:
            single_rate, single_tc = install_rates(backend, bulk=False)
            print(f"install one by one: {single_rate:.0f} rules/s, tc -batch {single_tc:.0f}")
            ours_rate, tc_rate = install_rates(backend, bulk=True)
            print(f"install in one bulk call: {ours_rate:.0f} rules/s, tc -batch {tc_rate:.0f}")
            (tcp_loaded, udp_loaded), (tcp_bare, udp_bare) = forwarding(backend)
    finally:
        teardown()
    print(f"TCP {tcp_loaded:.1f} vs {tcp_bare:.1f} MB/s, UDP {udp_loaded:.1f} vs {udp_bare:.1f}")
    return [
        Result(
            f"install {RULES} flower rules, one bulk call",
            ours_rate,
            tc_rate,
            "rules/s",
            "tc -batch",
            note=f"medians of {BULK_ROUNDS} interleaved rounds",
        ),
        Result(  # one call per rule: the name earlier runs used
            f"install {RULES} flower rules",
            single_rate,
            single_tc,
            "rules/s",
            "tc -batch",
        ),
        Result(
            f"TCP h1->h2, {RULES} rules ahead", tcp_loaded, tcp_bare, "MB/s", "forward rule alone"
        ),
        Result(
            f"UDP {UDP_PAYLOAD} B h1->h2, {RULES} rules ahead",
            udp_loaded,
            udp_bare,
            "MB/s",
            "forward rule alone",
        ),
    ]


def main() -> list[Result]:
    """Measure here when tc flower works, else in the test VM."""
    return common.run_vm_bench(NAME, measure, flower_unusable)


if __name__ == "__main__":
    common.command_line(__doc__)
    main()
