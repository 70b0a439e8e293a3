"""Checkpoints: the whole metadata as of a point in the log (format in layout.py).

Two slots (`checkpoint.0`, `checkpoint.1`); checkpoint n goes to slot n % 2, so the
previous one stays intact while the next is written, and the log blocks after the
previous one are freed only once the next is durable. Opening takes the valid slot
with the higher number; a torn checkpoint fails its CRC and the other slot counts.

`capture` runs under the engine's lock and costs a dict copy per map (block maps
are frozen, not copied); `persist` serializes and syncs without the lock.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import TYPE_CHECKING, Final

import crc32c

from dpu_agent.storage.blockmap import BlockMap, Chunk
from dpu_agent.storage.errors import DataCorruption
from dpu_agent.storage.layout import (
    CHUNK_BYTES,
    CHUNK_RECORD,
    CKPT_HEADER_BYTES,
    NODE,
    CheckpointHeader,
    LogPosition,
    chunk_bytes,
    chunk_from,
    pack_strings,
    qos_fields,
    services_of,
    unpack_strings,
)
from dpu_agent.storage.state import SNAPSHOT, VOLUME, Node, State
from dpu_agent.storage.types import QosLimits

if TYPE_CHECKING:
    from collections.abc import Iterator

    from dpu_agent.storage.media import StoreFile

SLOTS: Final = ("checkpoint.0", "checkpoint.1")
_WRITE_BYTES: Final = 1 << 20
_KINDS: Final = {VOLUME: 1, SNAPSHOT: 2}
_KIND_NAMES: Final = {v: k for k, v in _KINDS.items()}
_COUNTS: Final = CHUNK_RECORD  # u32


@dataclasses.dataclass(frozen=True)
class NodeImage:
    """A node's fields and its frozen map, as captured."""

    fields: tuple[int, ...]
    strings: tuple[str | bytes | None, ...]
    chunks: dict[int, Chunk]


@dataclasses.dataclass(frozen=True)
class Image:
    """What a checkpoint will hold."""

    number: int
    position: LogPosition
    next_node: int
    nodes: list[NodeImage]


def capture(state: State, number: int, position: LogPosition) -> Image:
    """The state now (call under the engine's lock)."""
    nodes = []
    for node in state.nodes.values():
        chunks = node.map.freeze()
        fields = (
            _KINDS[node.kind],
            node.node,
            node.parent.node if node.parent is not None else 0,
            node.parent_limit,
            node.size_bytes,
            node.block_size,
            int(node.services.crc32c),
            node.create_ns,
            node.update_ns,
            *qos_fields(node.qos),
            int(node.cloned),
            len(chunks),
        )
        strings = (
            node.name,
            node.tenant,
            str(node.services.compression),
            str(node.services.encryption),
            node.source,
            node.sealed_key,
        )
        nodes.append(NodeImage(fields, strings, chunks))
    return Image(number, position, state.next_node, nodes)


def _body(image: Image) -> Iterator[bytes]:
    yield _COUNTS.pack(image.next_node) + _COUNTS.pack(len(image.nodes))
    for node in image.nodes:
        yield NODE.pack(*node.fields) + pack_strings(*node.strings)
        for index in sorted(node.chunks):
            yield CHUNK_RECORD.pack(index)
            yield from chunk_bytes(node.chunks[index])


def persist(slot: StoreFile, image: Image) -> int:
    """Write the image into its slot and sync it; returns the bytes written."""
    crc = 0
    offset = CKPT_HEADER_BYTES
    pending: list[bytes] = []
    pending_bytes = 0
    for part in _body(image):
        pending.append(part)
        pending_bytes += len(part)
        if pending_bytes >= _WRITE_BYTES:
            data = b"".join(pending)
            slot.pwrite(data, offset)
            crc = crc32c.crc32c(data, crc)
            offset += len(data)
            pending, pending_bytes = [], 0
    data = b"".join(pending)
    slot.pwrite(data, offset)
    crc = crc32c.crc32c(data, crc)
    body_len = offset + len(data) - CKPT_HEADER_BYTES
    slot.pwrite(CheckpointHeader(image.number, body_len, crc, image.position).pack(), 0)
    slot.sync()
    return body_len + CKPT_HEADER_BYTES


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A checkpoint read back."""

    number: int
    position: LogPosition
    state: State


def load_newest(slots: list[StoreFile]) -> Loaded | None:
    """The valid checkpoint with the highest number, or None if no slot holds one."""
    best: Loaded | None = None
    for slot in slots:
        header = CheckpointHeader.parse(slot.pread(CKPT_HEADER_BYTES, 0))
        if header is None or (best is not None and header.number <= best.number):
            continue
        body = slot.pread(header.body_len, CKPT_HEADER_BYTES)
        if crc32c.crc32c(body) != header.body_crc:
            continue
        best = Loaded(header.number, header.position, parse_body(body))
    return best


def parse_body(body: bytes) -> State:
    """The state a checkpoint body holds."""
    view = memoryview(body)
    try:
        (next_node,) = _COUNTS.unpack_from(view, 0)
        (count,) = _COUNTS.unpack_from(view, 4)
        at = 8
        state = State()
        parents: dict[int, int] = {}
        for _ in range(count):
            fields = NODE.unpack_from(view, at)
            at += NODE.size
            (kind, number, parent, parent_limit, size, bs, crc, create_ns, update_ns) = fields[:9]
            qos = QosLimits(*fields[9:13])
            cloned, nchunks = fields[13], fields[14]
            raw, at = unpack_strings(view, at, 6)
            name, tenant, comp, enc, source, sealed = raw
            node = Node(
                number,
                _KIND_NAMES[kind],
                name.decode(),
                tenant.decode(),
                size,
                bs,
                services_of(crc, comp, enc),
                create_ns,
                update_ns,
                sealed or None,
                qos,
                source.decode(),
                BlockMap(),
                None,
                parent_limit,
                bool(cloned),
            )
            for _ in range(nchunks):
                (index,) = CHUNK_RECORD.unpack_from(view, at)
                at += CHUNK_RECORD.size
                if at + CHUNK_BYTES > len(view):
                    raise DataCorruption("a checkpoint is cut short")
                chunk = chunk_from(view[at : at + CHUNK_BYTES])
                at += CHUNK_BYTES
                node.map.load(index, chunk)
            if parent:
                parents[number] = parent
            state.add(node)
        state.next_node = max(state.next_node, next_node)
        for number, parent in parents.items():
            child, up = state.node(number), state.node(parent)
            child.parent = up
            up.children.append(child)
    except (struct.error, ValueError, KeyError, UnicodeDecodeError) as exc:
        raise DataCorruption(f"a checkpoint of the volume store cannot be read: {exc}") from None
    return state
