"""Where rules go among tc prefs (`dpu_agent.network.layout`): pure, no kernel.

The property that matters is the datapath's: for any packet, the first rule by
priority that matches it is the one the kernel finds (prefs in order; within a pref
one hash lookup per mask). The property test checks that with a model of both.
"""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpu_agent.network.flower import rule_cookie
from dpu_agent.network.layout import Slot, place, runs
from dpu_agent.network.model import Drop, FlowMatch, FlowRule
from dpu_agent.network.tc_backend import TcFlowBackend

A, B = ("ip", 0, "dst/32"), ("ip", 0, "dst/24")


def slots(*specs: tuple[int, object, str], current: dict[int, int] | None = None) -> list[Slot]:
    current = current or {}
    return [Slot(p, g, k.encode(), current.get(p)) for p, g, k in specs]


def test_consecutive_rules_with_one_mask_share_the_pref_of_the_first():
    rules = slots(*((p, A, f"k{p}") for p in range(1, 1001)))
    where = place(rules, ())
    assert set(where.values()) == {1}


def test_a_mask_change_starts_a_new_pref_and_prefs_follow_priorities():
    rules = slots((10, A, "a"), (11, A, "b"), (20, B, "c"), (21, B, "d"), (30, A, "e"))
    assert place(rules, ()) == {10: 10, 11: 10, 20: 20, 21: 20, 30: 30}


def test_a_repeated_key_starts_a_new_run():
    rules = slots((1, A, "a"), (2, A, "b"), (3, A, "a"), (4, A, "c"))
    assert [[s.priority for s in run] for run in runs(rules, ())] == [[1, 2], [3, 4]]
    assert place(rules, ()) == {1: 1, 2: 1, 3: 3, 4: 3}


def test_a_filter_of_someone_else_splits_a_run_and_no_rule_takes_its_pref():
    rules = slots((1, A, "a"), (2, A, "b"), (5, A, "c"), (6, A, "d"))
    assert place(rules, {4}) == {1: 1, 2: 1, 5: 5, 6: 5}
    with pytest.raises(ValueError, match="pref"):
        place(slots((4, A, "a")), {4})
    with pytest.raises(ValueError, match="share a priority"):
        place(slots((4, A, "a"), (4, B, "b")), ())


def test_appending_and_removing_keep_every_existing_pref():
    before = {10: 10, 11: 10, 12: 10}
    grown = slots((10, A, "a"), (11, A, "b"), (12, A, "c"), (13, A, "d"), current=before)
    assert place(grown, ()) == {10: 10, 11: 10, 12: 10, 13: 10}
    shrunk = slots((11, A, "b"), (12, A, "c"), current=before)  # the first one removed
    assert place(shrunk, ()) == {11: 10, 12: 10}
    prepended = slots((5, A, "z"), (10, A, "a"), (11, A, "b"), (12, A, "c"), current=before)
    assert place(prepended, ()) == {5: 10, 10: 10, 11: 10, 12: 10}


def test_a_run_below_a_kept_pref_takes_the_next_free_one():
    before = {20: 20, 21: 20}
    rules = slots((5, B, "z"), (20, A, "a"), (21, A, "b"), current=before)
    assert place(rules, ()) == {5: 5, 20: 20, 21: 20}
    crowded = {20: 3, 21: 3}  # kept prefs below a new, lower run's priority
    rules = slots((5, B, "z"), (20, A, "a"), (21, A, "b"), current=crowded)
    where = place(rules, ())
    assert where[5] < where[20] == where[21]


def test_inserting_another_mask_in_a_run_moves_only_its_tail():
    before = dict.fromkeys((p for p in range(10, 20) if p != 15), 10)
    rules = slots(*((p, A, f"k{p}") for p in before), current=before)
    where = place([*rules, Slot(15, B, b"x")], ())
    moved = sorted(p for p, pref in where.items() if p in before and pref != before[p])
    assert moved == [16, 17, 18, 19]
    assert where[15] == 15
    assert {where[p] for p in (16, 17, 18, 19)} == {16}


# --------------------------------------------------------------------------- the property

GROUPS = ("g0", "g1", "g2")
KEYS = ("k0", "k1", "k2", "k3")


@st.composite
def port_states(draw: st.DrawFn) -> tuple[list[Slot], set[int], list[Slot]]:
    """Rules before and after a change on one port, where the before ones are placed."""
    priorities = draw(st.lists(st.integers(1, 60), min_size=1, max_size=25, unique=True))
    barriers = set(draw(st.lists(st.integers(1, 60), max_size=4))) - set(priorities)
    specs = {p: (draw(st.sampled_from(GROUPS)), draw(st.sampled_from(KEYS))) for p in priorities}
    before = [Slot(p, g, k.encode()) for p, (g, k) in specs.items()]
    where = place(before, barriers)
    kept = [
        Slot(s.priority, s.group, s.key, where[s.priority]) for s in before if draw(st.booleans())
    ]
    free = [p for p in range(1, 61) if p not in specs and p not in barriers]
    added = draw(st.lists(st.sampled_from(free), max_size=6, unique=True)) if free else []
    after = kept + [
        Slot(p, draw(st.sampled_from(GROUPS)), draw(st.sampled_from(KEYS)).encode()) for p in added
    ]
    return before, barriers, after


def matches(entry: Slot | str, packet: dict[str, bytes]) -> bool:
    """A rule matches when the packet's key under its mask is the rule's; a barrier
    (someone else's filter) is taken to match everything."""
    return not isinstance(entry, Slot) or packet.get(str(entry.group)) == entry.key


def first_by_priority(
    rules: list[Slot], barriers: set[int], packet: dict[str, bytes]
) -> Slot | str | None:
    """What the rules mean: the lowest priority matching."""
    entries: list[tuple[int, Slot | str]] = [(s.priority, s) for s in rules]
    entries += [(b, "barrier") for b in barriers]
    for _, entry in sorted(entries, key=lambda e: e[0]):
        if matches(entry, packet):
            return entry
    return None


def first_by_kernel(
    rules: list[Slot], barriers: set[int], where: dict[int, int], packet: dict[str, bytes]
) -> Slot | str | None:
    """What the kernel does: prefs in order; in a pref, any filter whose masked key
    matches."""
    by_pref: dict[int, list[Slot | str]] = {}
    for s in rules:
        by_pref.setdefault(where[s.priority], []).append(s)
    for b in barriers:
        by_pref.setdefault(b, []).append("barrier")
    for pref in sorted(by_pref):
        hits = [e for e in by_pref[pref] if matches(e, packet)]
        assert len(hits) <= 1, f"two filters of pref {pref} match one packet: {hits}"
        if hits:
            return hits[0]
    return None


@settings(max_examples=400, deadline=None)
@given(port_states(), st.data())
def test_the_kernel_finds_the_rule_the_priorities_say(state, data):
    _, barriers, after = state
    where = place(after, barriers)
    assert all(1 <= pref <= 65535 for pref in where.values())
    for pref in set(where.values()):
        members = [s for s in after if where[s.priority] == pref]
        assert len({s.group for s in members}) == 1
        assert len({s.key for s in members}) == len(members)
        assert pref not in barriers
    for _ in range(12):
        packet = {g: data.draw(st.sampled_from(KEYS)).encode() for g in GROUPS}
        assert first_by_kernel(after, barriers, where, packet) == first_by_priority(
            after, barriers, packet
        )


# ------------------------------------------- the tc backend's own bookkeeping, no kernel

NETS = {
    "dst32": [f"10.0.0.{i}/32" for i in range(1, 5)],
    "dst24": ["10.0.0.0/24", "10.0.1.0/24"],
    "src32": [f"10.0.0.{i}/32" for i in range(1, 3)],
}


def flow(priority: int, kind: str, net: str) -> FlowRule:
    field = "src_ip" if kind.startswith("src") else "dst_ip"
    match = FlowMatch(**{field: ipaddress.ip_network(net)})  # type: ignore[arg-type]
    return FlowRule(f"r{priority}", priority, "rep1", match, (Drop(),))


def hits(rule: FlowRule, packet: tuple[str, str]) -> bool:
    src, dst = (ipaddress.ip_address(a) for a in packet)
    m = rule.match
    return (m.dst_ip is None or dst in m.dst_ip) and (m.src_ip is None or src in m.src_ip)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 80), st.sampled_from(sorted(NETS)), st.integers(0, 3)),
        min_size=1,
        max_size=30,
    ),
    st.sets(st.integers(1, 80), max_size=3),
)
def test_rules_installed_one_by_one_stay_in_priority_order(steps, barriers):
    """Each install takes the backend's quick path or the whole port's layout; after
    every one the kernel (modelled) finds the rule the priorities say."""
    backend = TcFlowBackend(("rep*",))
    try:
        port = backend._classify([])  # the bookkeeping under test
        port.barriers, port.fences = set(barriers), sorted(barriers)
        backend._ports[1] = port
        rules: dict[int, FlowRule] = {}
        for priority, kind, pick in steps:
            if priority in rules or priority in barriers:
                continue
            rule = flow(priority, kind, NETS[kind][pick % len(NETS[kind])])
            plan = backend._plan(1, port, [], [rule], lambda _name: 5)
            backend._commit([], [plan])
            rules[priority] = rule
            where = {r.priority: port.ours[rule_cookie(r.rule_id)].pref for r in rules.values()}
            assert sorted(port.order) == port.order == sorted(rules)
            for packet in [(f"10.0.{a}.{b}", f"10.0.{c}.{d}") for a, b, c, d in PACKETS]:
                by_priority = min(
                    [p for p, r in rules.items() if hits(r, packet)] + list(barriers),
                    default=None,
                )
                by_pref: dict[int, list[int]] = {}
                for p, r in rules.items():
                    if hits(r, packet):
                        by_pref.setdefault(where[p], []).append(p)
                for b in barriers:
                    by_pref.setdefault(b, []).append(b)
                first = by_pref[min(by_pref)] if by_pref else []
                assert len(first) <= 1, f"pref {min(by_pref)} has two matches: {first}"
                assert (first[0] if first else None) == by_priority
    finally:
        backend.close()


PACKETS = [(0, 1, 0, 1), (0, 2, 0, 3), (0, 1, 1, 4), (1, 1, 0, 2), (0, 3, 0, 4)]


def test_the_managed_names_remembered_are_bounded_and_the_answer_stays_right():
    """Port names come from clients' rules: the memory of which match stays bounded."""
    from dpu_agent.network.tc_backend import MANAGED_NAMES_KEPT  # noqa: PLC0415 - the bound

    backend = TcFlowBackend(("rep*", "pf0vf*"))
    try:
        names = [f"{'rep' if n % 2 else 'eth'}{n}" for n in range(2 * MANAGED_NAMES_KEPT)]
        for _ in range(2):  # asked again: remembered or not, the same answers
            assert [backend.managed(n) for n in names] == [n.startswith("rep") for n in names]
        assert len(backend._managed) == MANAGED_NAMES_KEPT
        assert backend.managed("pf0vf3")
        assert not backend.managed("pf1vf3")
    finally:
        backend.close()
