"""Metadata records: encoding a change (layout.RECORDS) and replaying it on a State.

The engine applies a change with `State.apply_*` and logs the record made here from
the same values; recovery decodes the record and calls the same `apply_*` (see
state.py). A write record's entries are checked against their data's CRC32C during
replay when the caller asks (`verify`): an entry whose data did not reach the disk
is skipped, so its block keeps what it had.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from dpu_agent.storage.blockmap import ZERO, Entry
from dpu_agent.storage.errors import DataCorruption
from dpu_agent.storage.layout import (
    BATCH,
    CREATE,
    DELETE_SNAPSHOT,
    DELETE_VOLUME,
    QOS,
    RECORDS,
    RESIZE,
    SNAPSHOT,
    TRIM,
    WRITE,
    WRITE_ENTRY,
    qos_fields,
    record,
    services_of,
    unpack_strings,
)
from dpu_agent.storage.state import SNAPSHOT as SNAPSHOT_KIND
from dpu_agent.storage.state import VOLUME, Free, Node, State
from dpu_agent.storage.types import QosLimits

Verify = Callable[[Node, int, Entry], bool]  # (node, block, entry) -> the data is intact


def create_record(node: Node) -> bytes:
    """The record of a new volume (a clone if `node.parent` is set)."""
    return record(
        CREATE,
        node.node,
        node.parent.node if node.parent is not None else 0,
        node.size_bytes,
        node.block_size,
        int(node.services.crc32c),
        node.create_ns,
        *qos_fields(node.qos),
        strings=(
            node.name,
            node.tenant,
            str(node.services.compression),
            str(node.services.encryption),
            node.source,
            node.sealed_key,
        ),
    )


def delete_volume_record(number: int) -> bytes:
    """The record of a volume deleted."""
    return record(DELETE_VOLUME, number)


def resize_record(number: int, size_bytes: int, update_ns: int) -> bytes:
    """The record of a resize."""
    return record(RESIZE, number, size_bytes, update_ns)


def trim_record(number: int, first: int, count: int) -> bytes:
    """The record of a trim."""
    return record(TRIM, number, first, count)


def snapshot_record(volume: int, snap: Node) -> bytes:
    """The record of a snapshot taken."""
    return record(SNAPSHOT, volume, snap.node, snap.create_ns, strings=(snap.name, snap.sealed_key))


def delete_snapshot_record(number: int) -> bytes:
    """The record of a snapshot deleted."""
    return record(DELETE_SNAPSHOT, number)


def qos_record(number: int, limits: QosLimits, update_ns: int) -> bytes:
    """The record of new QoS limits."""
    return record(QOS, number, update_ns, *qos_fields(limits))


def _entries(fields: tuple[int, ...], body: memoryview) -> list[Entry | None]:
    count = fields[2]
    at = RECORDS[WRITE][1].size
    if at + count * WRITE_ENTRY.size > len(body):
        raise DataCorruption("a write record is cut short")
    return [WRITE_ENTRY.unpack_from(body, at + i * WRITE_ENTRY.size) for i in range(count)]


def check_write(
    state: State, kind: int, body: memoryview, verify: Verify
) -> tuple[bool, list[tuple[int, int]]]:
    """A write record's check: whether every block's data matches its CRC, and blocks.

    The blocks are (sector, block size) of each one it points to. (True, []) for the
    other kinds.
    """
    if kind != WRITE:
        return True, []
    try:
        fields = RECORDS[WRITE][1].unpack_from(body, 0)
    except struct.error as exc:
        raise DataCorruption(f"a metadata record cannot be read: {exc}") from None
    number, first, _ = fields
    node = state.node(number)
    entries = _entries(fields, body)
    intact = all(e is not None and verify(node, first + i, e) for i, e in enumerate(entries))
    return intact, [(e[0], node.block_size) for e in entries if e is not None and e[0] > ZERO]


def _write(
    state: State, fields: tuple[int, ...], body: memoryview, verify: Verify | None
) -> list[Free]:
    number, first, _ = fields
    entries = _entries(fields, body)
    if verify is not None:
        node = state.node(number)
        entries = [
            e if e is not None and verify(node, first + i, e) else None
            for i, e in enumerate(entries)
        ]
    return state.apply_write(number, first, entries)


def _create(
    state: State, fields: tuple[int, ...], body: memoryview, _: Verify | None
) -> list[Free]:
    number, parent, size, bs, crc, create_ns, *limits = fields
    strings, _at = unpack_strings(body, RECORDS[CREATE][1].size, 6)
    name, tenant, comp, enc, source, sealed = strings
    node = Node(
        number,
        VOLUME,
        name.decode(),
        tenant.decode(),
        size,
        bs,
        services_of(crc, comp, enc),
        create_ns,
        create_ns,
        sealed or None,
        QosLimits(*limits),
        source.decode(),
    )
    if parent:
        node.parent = state.node(parent)
    return state.apply_create(node)


def _snapshot(
    state: State, fields: tuple[int, ...], body: memoryview, _: Verify | None
) -> list[Free]:
    volume_number, snap_number, create_ns = fields
    (name, sealed), _at = unpack_strings(body, RECORDS[SNAPSHOT][1].size, 2)
    volume = state.node(volume_number)
    snap = Node(
        snap_number,
        SNAPSHOT_KIND,
        name.decode(),
        volume.tenant,
        volume.size_bytes,
        volume.block_size,
        volume.services,
        create_ns,
        create_ns,
        sealed or None,
        source=volume.name,
    )
    return state.apply_snapshot(volume_number, snap)


def _qos(state: State, fields: tuple[int, ...], _body: memoryview, _: Verify | None) -> list[Free]:
    number, update_ns, *limits = fields
    return state.apply_qos(number, QosLimits(*limits), update_ns)


_Replay = Callable[[State, tuple[int, ...], memoryview, Verify | None], list[Free]]
_REPLAY: dict[int, _Replay] = {
    CREATE: _create,
    DELETE_VOLUME: lambda state, f, _b, _v: state.apply_delete_volume(f[0]),
    RESIZE: lambda state, f, _b, _v: state.apply_resize(*f),
    WRITE: _write,
    TRIM: lambda state, f, _b, _v: state.apply_trim(*f),
    SNAPSHOT: _snapshot,
    DELETE_SNAPSHOT: lambda state, f, _b, _v: state.apply_delete_snapshot(f[0]),
    QOS: _qos,
    BATCH: lambda _state, _f, _b, _v: [],  # where a commit starts: read by recovery itself
}
assert set(_REPLAY) == set(RECORDS)  # noqa: S101 - every record type replays


def replay(state: State, kind: int, body: memoryview, verify: Verify | None = None) -> list[Free]:
    """Apply one decoded record to `state`."""
    if kind not in _REPLAY:
        raise DataCorruption(f"unknown metadata record type {kind}")
    try:
        fields = RECORDS[kind][1].unpack_from(body, 0)
        return _REPLAY[kind](state, fields, body, verify)
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        raise DataCorruption(f"a metadata record cannot be read: {exc}") from None
