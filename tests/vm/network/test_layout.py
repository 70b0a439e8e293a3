"""Rules that share a mask share a tc pref, in the kernel, with priorities kept exact.

`dpu_agent.network.layout` decides; these check what the kernel holds (`tc filter
show`) and what real packets do.
"""

from __future__ import annotations

import ipaddress
import re

import pytest

from dpu_agent.errors import AlreadyExists
from dpu_agent.network.model import Count, Drop, FlowMatch, FlowRule, Forward, InstalledRule
from dpu_agent.network.tc_backend import TcFlowBackend
from tests.vm.network.topology import DPU, ping, sh

pytestmark = pytest.mark.tc

H2 = "10.10.0.2"


def prefs(port: str) -> list[int]:
    """The distinct prefs on a port's ingress, as the kernel lists them."""
    shown = sh("tc", "-n", DPU, "filter", "show", "dev", port, "ingress").stdout
    return sorted({int(p) for p in re.findall(r"\bpref (\d+)\b", shown)})


def handles(port: str) -> dict[int, int]:
    """handle -> pref of every flower filter on a port's ingress."""
    shown = sh("tc", "-n", DPU, "filter", "show", "dev", port, "ingress").stdout
    found = re.findall(r"pref (\d+) flower chain \d+ handle (0x[0-9a-f]+)", shown)
    return {int(handle, 16): int(pref) for pref, handle in found}


def drops(count: int, first: int = 1) -> list[FlowRule]:
    """Drop rules on rep1 at priorities first.., for 10.99.x.y/32 (no test packet goes there)."""
    return [
        FlowRule(
            f"drop-{p}",
            p,
            "rep1",
            FlowMatch(dst_ip=ipaddress.ip_network(f"10.99.{p // 250}.{p % 250 + 1}/32")),
            (Drop(),),
        )
        for p in range(first, first + count)
    ]


FORWARD = FlowRule("fwd-1-2", 1000, "rep1", FlowMatch(), (Forward("rep2"),))
BACK = FlowRule("fwd-2-1", 1000, "rep2", FlowMatch(), (Forward("rep1"),))


def test_one_mask_one_pref_and_a_rule_of_another_mask_keeps_its_place(backend):
    block_h2 = FlowRule(
        "block-h2", 150, "rep1", FlowMatch(dst_ip=ipaddress.ip_network(f"{H2}/32")), (Drop(),)
    )
    rules = [*drops(99), *drops(49, first=101), block_h2, *drops(50, first=151), FORWARD, BACK]
    backend.apply([], rules)
    assert prefs("rep1") == [1, 1000]  # 199 drop rules in one pref, the forward in its own
    assert handles("rep1") == {
        **dict.fromkeys((p for p in range(1, 201) if p != 100), 1),
        1000: 1000,
    }
    assert backend.installed() == sorted(
        (InstalledRule(r.ingress_port, r.priority, r.rule_id) for r in rules),
        key=lambda r: (r.ingress_port, r.priority),
    )
    assert ping("h1", H2) == 0  # block-h2 (150) comes before the forward (1000)

    # A /24 rule at 100 goes between: the run's tail (101..200) moves to pref 101.
    allow = FlowRule(
        "allow-h2",
        100,
        "rep1",
        FlowMatch(dst_ip=ipaddress.ip_network("10.10.0.0/24")),
        (Count(), Forward("rep2")),
    )
    backend.install(allow)
    assert prefs("rep1") == [1, 100, 101, 1000]
    assert handles("rep1")[150] == 101
    assert handles("rep1")[99] == 1
    assert ping("h1", H2) == 3  # allow-h2 (100) now comes first
    assert backend.counters(allow).packets >= 3
    assert backend.counters(block_h2).packets == 0

    backend.remove(allow)  # nothing else moves
    assert prefs("rep1") == [1, 101, 1000]
    assert ping("h1", H2) == 0
    assert backend.counters(block_h2).packets >= 3
    backend.apply(rules, [])
    assert prefs("rep1") == []


@pytest.mark.usefixtures("backend")  # removes the filters afterwards
def test_someone_elses_filter_between_rules_splits_the_run():
    # reread_after=0: every install reads the port (by default a read is trusted for 1 s)
    with TcFlowBackend(("rep*",), netns=DPU, reread_after=0.0) as backend:
        backend.apply([], drops(10))
        sh(
            *("tc", "-n", DPU, "filter", "add", "dev", "rep1", "ingress", "pref", "20"),
            *("protocol", "ip", "flower", "dst_ip", H2, "action", "pass"),
        )
        for rule in drops(10, first=30):  # one by one, as CreateFlowRule does
            backend.install(rule)
        assert prefs("rep1") == [1, 20, 30]
        assert {r.priority for r in backend.installed() if r.rule_id is None} == {20}
        with pytest.raises(AlreadyExists, match="priority 20"):
            backend.install(drops(1, first=20)[0])


def test_a_restarted_agent_groups_new_rules_with_the_earlier_ones(backend):
    rules = drops(100)
    backend.apply([], rules)
    with TcFlowBackend(("rep*",), netns=DPU) as restarted:
        restarted.remember(rules)
        more = drops(20, first=101)
        restarted.apply([], more)
        assert prefs("rep1") == [1]
        restarted.remove(rules[50])
        assert len(restarted.installed()) == 119
        assert restarted.counters(more[-1]).packets == 0
        restarted.apply([*rules[:50], *rules[51:], *more], [])
    assert prefs("rep1") == []
