"""Hypothesis strategies for any protobuf message, built from its descriptor.

`MessageStrategies(hints).message(descriptor)` draws messages of that type with every
field kind: scalars at their extremes, open enums with unknown values, repeated
fields (now and then a long run of one element), maps, oneofs (at most one member
set), proto3 `optional` presence, nested messages down to a depth bound, strings
that are long, unicode, or shaped like resource names, and bytes.

A good share of the values are near-valid so that requests reach service logic
and not only the generic validation: `Hints.strings` gives real resource names and
ids for a string field (names of objects that exist), enums mostly take values the
enum defines, and integers lean to small and block-sized numbers.

`wire_bytes` wraps a message strategy into serialized requests, some of them damaged
on the wire (unknown fields, truncation, flipped bytes, invalid UTF-8, random bytes).
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from google.protobuf import descriptor as pbd
from google.protobuf import message_factory
from hypothesis import strategies as st

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from google.protobuf.message import Message

FD = pbd.FieldDescriptor

INT_RANGES: Final[dict[int, tuple[int, int]]] = {
    FD.TYPE_INT32: (-(2**31), 2**31 - 1),
    FD.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FD.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FD.TYPE_INT64: (-(2**63), 2**63 - 1),
    FD.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FD.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FD.TYPE_UINT32: (0, 2**32 - 1),
    FD.TYPE_FIXED32: (0, 2**32 - 1),
    FD.TYPE_UINT64: (0, 2**64 - 1),
    FD.TYPE_FIXED64: (0, 2**64 - 1),
}
_SPECIAL_INTS: Final = (
    -(2**63),
    -(2**31),
    -4096,
    -1,
    0,
    1,
    2,
    3,
    7,
    16,
    32,
    100,
    255,
    256,
    500,
    501,
    511,
    512,
    1024,
    4095,
    4096,
    4097,
    8192,
    65535,
    65536,
    1 << 20,
    (1 << 24) - 1,
    1 << 24,
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**32,
    2**53 + 1,
    2**62,
    2**63 - 1,
    2**63,
    2**64 - 1,
)
WEIRD_STRINGS: Final = (
    "",
    " ",
    "/",
    "//",
    ".",
    "..",
    "-",
    "a-",
    "-a",
    "A",
    "\x00",
    "\u202e",
    "é",
    "\U0001f600",
    "%s%n%x",
    "${jndi:ldap://x}",
    "' OR '1'='1",
    "../../../etc/passwd",
    "volumes/x",
    "volumes/",
    "volumes//",
    "volumes/x/",
    "volumes/X",
    "volumes/x/volumes/y",
    "sessions/..",
    "sessions/s-0",
    "sessions/s-0/regions/",
    "sessions/s-0/jobs/-1",
    "sessions/s-0/jobs/99999999999999999999999",
    "sessions/s-0/jobs/0x10",
    "flowRules/a b",
    "ports/../p0",
    "functions/f",
)
_LONG_LENGTHS: Final = (63, 64, 127, 128, 129, 255, 256, 257, 1023, 1024, 1025, 4097)
_COLLECTIONS: Final = (
    "sessions",
    "regions",
    "jobs",
    "volumes",
    "ports",
    "flowRules",
    "functions",
    "agents",
)
ID_REGEX: Final = r"[a-z0-9](?:[a-z0-9-]{0,10}[a-z0-9])?"


@dataclasses.dataclass(frozen=True)
class Hints:
    """Where near-valid values come from.

    Attributes:
        strings: real values (resource names, ids) for a string field, or (). The
            sequence is indexed when a value is drawn, so it may change in place.
        overrides: strategies for whole messages by full name, used instead of the
            generic one wherever the type occurs (e.g. endpoints the agent would
            dial: only safe addresses).
        templates: valid messages by full name; drawn with up to two fields
            overwritten by generic values, as often as generic messages are.
        max_depth: levels of nesting, the top message included; fields that would
            nest deeper are left unset.
    """

    strings: Callable[[pbd.FieldDescriptor], Sequence[str]] = lambda _field: ()
    overrides: Mapping[str, st.SearchStrategy[Message]] = dataclasses.field(default_factory=dict)
    templates: Mapping[str, st.SearchStrategy[Message]] = dataclasses.field(default_factory=dict)
    max_depth: int = 4


def weighted(*choices: tuple[st.SearchStrategy[Any], int]) -> st.SearchStrategy[Any]:
    """Draw from one of the strategies with roughly the given weights.

    (`st.one_of` does not weigh repeated branches.) Hypothesis leans to the ends of
    a sampled list, so the first choice, the one meant to dominate, also closes it.
    """
    first, weight = choices[0]
    pool = [first] * (weight - weight // 2)
    pool += [strategy for strategy, n in choices[1:] for _ in range(n)]
    pool += [first] * (weight // 2)
    return st.sampled_from(pool).flatmap(lambda strategy: strategy)


def integers(low: int, high: int) -> st.SearchStrategy[int]:
    """Integers in [low, high], leaning to extremes and to small and block-sized values."""
    special = sorted(
        {v for v in (*_SPECIAL_INTS, low, low + 1, high - 1, high) if low <= v <= high}
    )
    small = st.integers(max(low, -8), min(high, 70_000))
    return st.one_of(st.sampled_from(special), small, st.integers(low, high))


def long_text() -> st.SearchStrategy[str]:
    """One character repeated to a length around the API's limits."""
    return st.builds(
        lambda char, length: char * length,
        st.sampled_from(["a", "/", "é", "\U0001f600", "-", "0"]),
        st.sampled_from(_LONG_LENGTHS),
    )


def resource_like() -> st.SearchStrategy[str]:
    """Strings shaped like resource names: collection/id pairs, some of them broken."""
    ident = st.one_of(st.from_regex(ID_REGEX, fullmatch=True), st.sampled_from(WEIRD_STRINGS))
    pair = st.tuples(st.sampled_from(_COLLECTIONS), ident).map("/".join)
    return st.lists(pair, min_size=1, max_size=3).map("/".join)


def texts() -> st.SearchStrategy[str]:
    """Any string: unicode, weird, long, or resource-name-like."""
    return st.one_of(
        st.sampled_from(WEIRD_STRINGS),
        st.text(st.characters(codec="utf-8"), max_size=24),
        st.from_regex(ID_REGEX, fullmatch=True),
        resource_like(),
        long_text(),
    )


def binaries() -> st.SearchStrategy[bytes]:
    """Bytes: short random, key-sized (16/24/32/64 and one off), or long runs."""
    sized = st.sampled_from([0, 1, 15, 16, 17, 24, 31, 32, 33, 48, 64, 65]).flatmap(
        lambda n: st.binary(min_size=n, max_size=n)
    )
    long_run = st.builds(
        lambda b, n: b * n, st.binary(min_size=1, max_size=1), st.sampled_from([1024, 70_000])
    )
    return weighted((sized, 2), (st.binary(max_size=40), 1), (long_run, 1))


class MessageStrategies:
    """Builds (and caches) a strategy per message type and depth."""

    def __init__(self, hints: Hints) -> None:
        self.hints = hints
        self._cache: dict[tuple[str, int], st.SearchStrategy[Message]] = {}

    def message(self, desc: pbd.Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
        """Messages of type `desc`."""
        key = (desc.full_name, depth)
        if key not in self._cache:
            override = self.hints.overrides.get(desc.full_name)
            template = self.hints.templates.get(desc.full_name)
            if override is not None:
                self._cache[key] = override
            elif template is not None and desc.fields:
                mutated = self._mutated(desc, template, depth)
                self._cache[key] = weighted((mutated, 1), (self._build(desc, depth), 1))
            else:
                self._cache[key] = self._build(desc, depth)
        return self._cache[key]

    def _mutated(
        self, desc: pbd.Descriptor, template: st.SearchStrategy[Message], depth: int
    ) -> st.SearchStrategy[Message]:
        """A valid message with up to two of its fields set to generic values."""
        change = weighted(*((_named(f.name, self._field(f, depth)), 1) for f in desc.fields))
        return st.builds(_overwrite, template, st.lists(change, max_size=2))

    def _build(self, desc: pbd.Descriptor, depth: int) -> st.SearchStrategy[Message]:
        cls = message_factory.GetMessageClass(desc)
        if depth >= self.hints.max_depth:
            return st.just(cls())
        # Most fields are set (near-valid requests need them); each may be left out.
        # Nested messages get rarer with depth (`_presence`): the tree stays small.
        fields = [f for f in desc.fields if depth + 1 < self.hints.max_depth or not _nests(f)]
        plain = [
            weighted((_named(f.name, self._field(f, depth)), _presence(f, depth)), (st.none(), 2))
            for f in fields
            if f.containing_oneof is None
        ]
        # One member of each oneof (proto3 `optional` is a one-member oneof) or none.
        oneofs = [
            weighted(
                *((_named(f.name, self._field(f, depth)), 2) for f in oneof.fields if f in fields),
                (st.none(), 1),
            )
            for oneof in desc.oneofs
        ]
        return st.builds(_assemble, st.just(cls), st.tuples(*plain, *oneofs))

    def _field(self, field: pbd.FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
        most = (4, 2)[depth] if depth < 2 else 1
        if _is_map(field):
            entry = field.message_type
            assert entry is not None
            keys = self._single(entry.fields_by_name["key"], depth)
            values = self._single(entry.fields_by_name["value"], depth)
            return st.dictionaries(keys, values, max_size=most)
        single = self._single(field, depth)
        if not field.is_repeated:
            return single
        if depth > 1:
            return st.lists(single, max_size=most)
        # Mostly short lists; now and then one element repeated past typical limits.
        run = st.builds(lambda item, n: [item] * n, single, st.sampled_from([17, 1025]))
        return weighted((st.lists(single, max_size=most), 4), (run, 1))

    def _single(self, field: pbd.FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
        kind = field.type
        if kind in INT_RANGES:
            return integers(*INT_RANGES[kind])
        if kind in _PLAIN:
            return _PLAIN[kind]()
        if kind == FD.TYPE_STRING:
            return self._string(field)
        if kind == FD.TYPE_ENUM:
            enum = field.enum_type
            assert enum is not None
            return _enum(enum)
        if kind in (FD.TYPE_MESSAGE, FD.TYPE_GROUP):
            sub = field.message_type
            assert sub is not None
            return self.message(sub, depth + 1)
        raise AssertionError(f"field {field.full_name} has an unknown type {kind}")

    def _string(self, field: pbd.FieldDescriptor) -> st.SearchStrategy[str]:
        real = self.hints.strings(field)
        if not real:
            return texts()
        known = st.integers(0, 1 << 16).map(lambda i: real[i % len(real)] if real else "")
        return weighted((known, 3), (texts(), 1))


def _enum(enum: pbd.EnumDescriptor) -> st.SearchStrategy[int]:
    """Mostly defined values; an open (proto3) enum also gets unknown numbers."""
    known = st.sampled_from([v.number for v in enum.values])
    if enum.is_closed:
        return known
    unknown = st.one_of(
        st.sampled_from([max(v.number for v in enum.values) + 1, -1]),
        st.integers(-(2**31), 2**31 - 1),
    )
    return weighted((known, 4), (unknown, 1))


_PLAIN: Final[dict[int, Callable[[], st.SearchStrategy[Any]]]] = {
    FD.TYPE_BOOL: st.booleans,
    FD.TYPE_DOUBLE: st.floats,
    FD.TYPE_FLOAT: lambda: st.floats(width=32),
    FD.TYPE_BYTES: binaries,
}


def _nests(field: pbd.FieldDescriptor) -> bool:
    """Whether the field holds messages (a map whose values are messages counts)."""
    sub = field.message_type
    if sub is not None and _is_map(field):
        sub = sub.fields_by_name["value"].message_type
    return sub is not None


def _presence(field: pbd.FieldDescriptor, depth: int) -> int:
    """Odds, against 2, that a field is set: a scalar 6:2; a message 6:2 at the top
    level, then 2:2, then 1:2 deeper down, so that a recursive tree stays small."""
    if field.type not in (FD.TYPE_MESSAGE, FD.TYPE_GROUP):
        return 6
    return (6, 2)[depth] if depth < 2 else 1


def _named(name: str, values: st.SearchStrategy[Any]) -> st.SearchStrategy[tuple[str, Any]]:
    """(field name, value) pairs."""
    return st.tuples(st.just(name), values)


def _is_map(field: pbd.FieldDescriptor) -> bool:
    sub = field.message_type
    return bool(field.is_repeated and sub is not None and sub.GetOptions().map_entry)


def _assemble(cls: type[Message], chosen: tuple[tuple[str, Any] | None, ...]) -> Message:
    message = cls()
    for item in chosen:
        if item is not None:
            name, value = item
            _set(message, message.DESCRIPTOR.fields_by_name[name], value)
    return message


def _overwrite(message: Message, changes: list[tuple[str, Any]]) -> Message:
    out = type(message)()
    out.CopyFrom(message)
    for name, value in changes:
        out.ClearField(name)
        _set(out, out.DESCRIPTOR.fields_by_name[name], value)
    return out


def _set(message: Message, field: Any, value: Any) -> None:
    if _is_map(field):
        target = getattr(message, field.name)
        entry = field.message_type
        assert entry is not None
        for key, item in value.items():
            if entry.fields_by_name["value"].type == FD.TYPE_MESSAGE:
                target[key].CopyFrom(item)
            else:
                target[key] = item
    elif field.is_repeated:
        target = getattr(message, field.name)
        if field.type == FD.TYPE_MESSAGE:
            for item in value:
                target.add().CopyFrom(item)
        else:
            target.extend(value)
    elif field.type == FD.TYPE_MESSAGE:
        target = getattr(message, field.name)
        target.SetInParent()
        target.MergeFrom(value)
    else:
        setattr(message, field.name, value)


# ---------------------------------------------------------------------------- wire level
def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _unknown_field() -> st.SearchStrategy[bytes]:
    """One field the schema does not know (or a known number with the wrong wire type)."""
    number = st.one_of(st.integers(1, 40), st.integers(1, (1 << 29) - 1))
    varint = st.builds(lambda n, v: _varint(n << 3) + _varint(v), number, st.integers(0, 2**64 - 1))
    fixed64 = st.builds(
        lambda n, v: _varint(n << 3 | 1) + struct.pack("<Q", v), number, st.integers(0, 2**64 - 1)
    )
    blob = st.builds(
        lambda n, b: _varint(n << 3 | 2) + _varint(len(b)) + b, number, st.binary(max_size=16)
    )
    fixed32 = st.builds(
        lambda n, v: _varint(n << 3 | 5) + struct.pack("<I", v), number, st.integers(0, 2**32 - 1)
    )
    return st.one_of(varint, fixed64, blob, fixed32)


def _bad_utf8(desc: pbd.Descriptor) -> st.SearchStrategy[bytes] | None:
    strings = [f.number for f in desc.fields if f.type == FD.TYPE_STRING]
    if not strings:
        return None
    return st.builds(
        lambda n, junk: _varint(n << 3 | 2) + _varint(len(junk)) + junk,
        st.sampled_from(strings),
        st.sampled_from([b"\xff", b"\xc3", b"a\xed\xa0\x80b", b"\xf8\x88\x80\x80\x80"]),
    )


def wire_bytes(
    desc: pbd.Descriptor, messages: st.SearchStrategy[Message]
) -> st.SearchStrategy[bytes]:
    """Serialized requests of type `desc`: mostly intact, some damaged on the wire."""
    intact = messages.map(lambda m: m.SerializeToString())
    with_unknown = st.builds(lambda data, extra: data + extra, intact, _unknown_field())
    truncated = st.builds(
        lambda data, cut: data[: max(0, len(data) - cut)], intact, st.integers(1, 8)
    )
    flipped = st.builds(_flip, intact, st.integers(0, 1 << 16), st.integers(1, 255))
    damaged = [with_unknown, truncated, flipped, st.binary(max_size=64)]
    bad_utf8 = _bad_utf8(desc)
    if bad_utf8 is not None:
        damaged.append(st.builds(lambda data, bad: data + bad, intact, bad_utf8))
    return weighted((intact, 3 * len(damaged)), *((d, 1) for d in damaged))


def _flip(data: bytes, position: int, mask: int) -> bytes:
    if not data:
        return bytes([mask])
    index = position % len(data)
    return data[:index] + bytes([data[index] ^ mask]) + data[index + 1 :]
