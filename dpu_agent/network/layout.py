"""Where a port's flow rules go among tc's prefs: rules that share a mask share one.

Pure: no kernel, no sockets. `tc_backend` asks it where every rule of a port belongs
after a change and moves only what the answer moves.

Why: the kernel runs a port's ingress filters pref by pref, and each pref is one
flower instance that classifies the packet with one hash lookup per mask it holds.
One pref per rule makes every packet pay for every rule ahead of the one that
matches: with 1000 rules ahead, forwarding fell to 0.04-0.17 of the rate with the
forwarding rule alone (`bench/tc_layouts.py`); the same 1000 rules in one pref with
one mask kept 0.91. So consecutive rules (in priority order) with the same mask go
into one pref, and a packet pays per run of same-mask rules, not per rule.

Priority semantics stay exact. Within a pref, filters with the same mask and different
keys never both match a packet (a packet has one value under one mask), so their order
cannot matter; a rule whose key repeats one already in the run starts a new run (the
kernel would refuse the duplicate anyway). Runs keep the rules' order: run prefs
increase with the runs' priorities, and a run never spans a pref the agent does not
own (a "barrier": someone else's filter), whose pref stays between the rules around
it exactly as if it were a rule at that priority. The filter's handle is the rule's
priority, so the kernel's dump still says which rule is which.

A run keeps the pref it already has when that still fits, so a change moves as few
filters as it can: appending, prepending or removing rules moves none; inserting a
rule with another mask in the middle of a run moves the run's tail (added in its new
pref before it is deleted from the old, so it never stops matching; its counters
restart).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Collection, Hashable, Sequence

MAX_PREF = 0xFFFF  # tc's pref is 16 bits


@dataclasses.dataclass(frozen=True)
class Slot:
    """One of the agent's rules on a port, as the layout sees it."""

    priority: int  # the rule's priority (1..65535), unique on the port
    group: Hashable  # rules with equal groups may share a pref: protocol, flags, mask
    key: bytes  # the masked match: two rules of a run never have the same one
    pref: int | None = None  # where its filter is now; None when it is not installed


def runs(slots: Sequence[Slot], barriers: Collection[int]) -> list[list[Slot]]:
    """Maximal runs of consecutive same-group slots with distinct keys, in priority order.

    A run ends where the group changes, where a key repeats, and at a barrier pref
    between two priorities.
    """
    fences = sorted(barriers)
    found: list[list[Slot]] = []
    keys: set[bytes] = set()
    for slot in sorted(slots, key=lambda s: s.priority):
        if found:
            last = found[-1][-1]
            fenced = bisect.bisect_right(fences, slot.priority) > bisect.bisect_right(
                fences, last.priority
            )
            if slot.group == last.group and slot.key not in keys and not fenced:
                found[-1].append(slot)
                keys.add(slot.key)
                continue
        found.append([slot])
        keys = {slot.key}
    return found


def place(slots: Sequence[Slot], barriers: Collection[int]) -> dict[int, int]:
    """The pref of every slot (by priority) after the change the slots describe.

    Runs take increasing prefs, each between the barriers around it. A run keeps the
    pref most of its members are in when that fits; a run that cannot (or is new)
    takes its lowest priority, or the next pref up when that is taken. Should kept
    prefs leave a run no room before the next barrier, every run takes its lowest
    priority instead, which always fits.

    Raises ValueError if two slots share a priority or a slot's priority is a barrier
    (the caller refuses those first, with the rule's name).
    """
    priorities = [s.priority for s in slots]
    if len(set(priorities)) != len(priorities):
        raise ValueError("two rules share a priority")
    if set(priorities) & set(barriers):
        raise ValueError("a rule's priority is another filter's pref")
    found = runs(slots, barriers)
    fences = sorted(barriers)
    return _assign(found, fences, keep=True) or _assign(found, fences, keep=False) or {}


def _assign(found: list[list[Slot]], fences: Sequence[int], *, keep: bool) -> dict[int, int] | None:
    """Prefs for the runs in order, keeping current ones if `keep`; None if one has no room."""
    where: dict[int, int] = {}
    previous = 0
    for run in found:
        low, high = run[0].priority, run[-1].priority
        below = bisect.bisect_left(fences, low)
        floor = max(previous, fences[below - 1] if below else 0) + 1
        above = bisect.bisect_right(fences, high)
        ceiling = (fences[above] if above < len(fences) else MAX_PREF + 1) - 1
        pref = None
        if keep:
            current = collections.Counter(s.pref for s in run if s.pref is not None)
            for candidate, _ in sorted(current.items(), key=lambda item: (-item[1], item[0])):
                if floor <= candidate <= ceiling:
                    pref = candidate
                    break
        if pref is None:
            pref = max(floor, min(low, ceiling))
        if not floor <= pref <= ceiling:
            return None
        where.update((s.priority, pref) for s in run)
        previous = pref
    return where
