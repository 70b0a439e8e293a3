"""The store's metadata as a state machine: volumes, snapshots and their block maps.

Every change to the metadata is one call of an `apply_*` method, with plain values
as arguments. The engine calls them live (under its lock, encoding the same values
as a log record) and recovery calls them again from the decoded records, so the
state after a restart is the state that was logged, by construction.

Snapshots and clones are a chain of maps (as SPDK's lvol snapshots): a volume's own
map holds what was written since its last snapshot; a lookup that finds nothing
there goes on to its parent, a read-only snapshot, and so on up the chain. Taking a
snapshot moves the volume's map to the new snapshot and gives the volume an empty
one: time independent of the volume's size. A clone is a new volume whose parent is
a snapshot. Every physical block belongs to exactly one map, so nothing is counted
twice and no reference counts are needed: a write frees the block it replaces only
when that block was in the volume's own map; deleting a snapshot merges its map into
the one map that depends on it (freeing what that map hides), which is why a
snapshot with clones cannot be deleted.

`parent_limit` (blocks) bounds what a map may read from its parent: a shrink hides
the parent's blocks past the new end, so a later growth reads zeros there.

Each `apply_*` returns the physical blocks it freed, as (sector, bytes, discard):
the engine gives them back to the space map once the change is durable and no read
uses them any more; `discard` asks for the space to go back to the file system (a
trim, a delete) rather than be kept for the next write.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Final

from dpu_agent.storage.blockmap import (
    ABSENT,
    CHUNK_BLOCKS,
    CHUNK_MASK,
    CHUNK_SHIFT,
    ZERO,
    BlockMap,
    Entry,
)
from dpu_agent.storage.errors import DataCorruption
from dpu_agent.storage.types import NO_QOS, QosLimits, SnapshotInfo, VolumeInfo

if TYPE_CHECKING:
    from collections.abc import Iterable

    from dpu_agent.storage.types import DataServices

VOLUME: Final = "volume"
SNAPSHOT: Final = "snapshot"

Free = tuple[int, int, bool]  # (pool sector, bytes, discard)


@dataclasses.dataclass(eq=False)
class Node:
    """A volume (writable, named by its volume id) or a snapshot (read-only)."""

    node: int
    kind: str
    name: str
    tenant: str
    size_bytes: int
    block_size: int
    services: DataServices
    create_ns: int
    update_ns: int
    sealed_key: bytes | None = dataclasses.field(default=None, repr=False)
    qos: QosLimits = NO_QOS
    source: str = ""  # snapshot: the volume it was taken of; clone: its snapshot
    map: BlockMap = dataclasses.field(default_factory=BlockMap, repr=False)
    parent: Node | None = dataclasses.field(default=None, repr=False)
    parent_limit: int = 0  # blocks below this may come from the parent
    cloned: bool = False  # the edge to the parent is a clone's (not the volume's own chain)
    children: list[Node] = dataclasses.field(default_factory=list, repr=False)
    _info: VolumeInfo | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def blocks(self) -> int:
        """Number of blocks."""
        return self.size_bytes // self.block_size

    def depth(self) -> int:
        """Maps a lookup may visit: this one and its ancestors."""
        n, node = 1, self.parent
        while node is not None:
            n, node = n + 1, node.parent
        return n

    def volume_info(self) -> VolumeInfo:
        """The VolumeInfo of a volume node (made again only after a change)."""
        info = self._info
        if (
            info is None
            or info.size_bytes != self.size_bytes
            or info.update_ns != self.update_ns
            or info.qos is not self.qos
        ):
            info = self._info = VolumeInfo(
                self.name,
                self.size_bytes,
                self.block_size,
                self.services,
                self.create_ns,
                self.update_ns,
                self.tenant,
                self.qos,
                self.source,
            )
        return info

    def snapshot_info(self) -> SnapshotInfo:
        """The SnapshotInfo of a snapshot node."""
        return SnapshotInfo(
            self.name,
            self.source,
            self.size_bytes,
            self.block_size,
            self.services,
            self.create_ns,
            self.tenant,
            self.map.allocated * self.block_size,
            tuple(sorted(clone_volumes(self))),
        )


def clone_volumes(snapshot: Node) -> list[str]:
    """Ids of the volumes whose chain reaches `snapshot` through a clone."""
    found = []
    todo = [c for c in snapshot.children if c.cloned]
    while todo:
        node = todo.pop()
        if node.kind == VOLUME:
            found.append(node.name)
        todo.extend(node.children)
    return found


def resolve(node: Node, block: int) -> Entry | None:
    """The entry a read of `block` finds, walking up the chain; None reads zeros."""
    while True:
        chunk = node.map.chunks.get(block >> CHUNK_SHIFT)
        if chunk is not None:
            i = block & CHUNK_MASK
            phys = chunk.phys[i]
            if phys:
                return (phys, chunk.meta[i], chunk.crc[i]) if phys != ZERO else None
        parent = node.parent
        if parent is None or block >= node.parent_limit:
            return None
        node = parent


def visible_in_parents(node: Node, first: int, end: int) -> set[int]:
    """Blocks in [first, end) that some ancestor has an entry for (and `node` may see)."""
    found: set[int] = set()
    limit, parent = node.parent_limit, node.parent
    while parent is not None and first < min(end, limit):
        found.update(b for b, _ in parent.map.present(first, min(end, limit)))
        limit = min(limit, parent.parent_limit)
        parent = parent.parent
    return found


def next_to_trim(node: Node, first: int, end: int) -> int | None:
    """The first block in [first, end) that a trim of `node` may have to change, or None.

    That is a block with an entry in `node`'s map, or in an ancestor's that `node` may
    see (the blocks `visible_in_parents` finds): `State.trim` of a range without any
    changes nothing. Costs what the maps hold, not the range's length
    (`BlockMap.next_entry`).
    """
    found = node.map.next_entry(first, end)
    if found is not None:
        end = found  # only an earlier block of an ancestor matters now
    limit, parent = node.parent_limit, node.parent
    while parent is not None and first < min(end, limit):
        hit = parent.map.next_entry(first, min(end, limit))
        if hit is not None:
            found = end = hit
        limit = min(limit, parent.parent_limit)
        parent = parent.parent
    return found


class State:
    """Every volume and snapshot. Not thread-safe: the engine holds its lock around it."""

    def __init__(self) -> None:
        self.nodes: dict[int, Node] = {}
        self.volumes: dict[str, Node] = {}
        self.snapshots: dict[str, Node] = {}
        # (tenant, kind) -> its volumes or snapshots by id: a tenant's listing and quota
        # walk its own objects, not the store's (the data plane waits for the lock)
        self.owned: dict[tuple[str, str], dict[str, Node]] = {}
        self.next_node = 1

    def of(self, tenant: str, kind: str) -> dict[str, Node]:
        """The tenant's volumes (kind VOLUME) or snapshots by id (do not change it)."""
        return self.owned.get((tenant, kind), {})

    def node(self, number: int) -> Node:
        """The node with that number; DataCorruption if there is none (a bad record)."""
        found = self.nodes.get(number)
        if found is None:
            raise DataCorruption(
                f"the volume metadata names an unknown volume or snapshot {number}"
            )
        return found

    def add(self, node: Node) -> None:
        """Register a node (a new one, or one loaded from a checkpoint)."""
        if node.node in self.nodes:
            raise DataCorruption(f"the volume metadata has volume or snapshot {node.node} twice")
        self.nodes[node.node] = node
        (self.volumes if node.kind == VOLUME else self.snapshots)[node.name] = node
        self.owned.setdefault((node.tenant, node.kind), {})[node.name] = node
        self.next_node = max(self.next_node, node.node + 1)

    def _remove(self, node: Node) -> None:
        del self.nodes[node.node]
        del (self.volumes if node.kind == VOLUME else self.snapshots)[node.name]
        owned = self.owned[node.tenant, node.kind]
        del owned[node.name]
        if not owned:
            del self.owned[node.tenant, node.kind]
        if node.parent is not None:
            node.parent.children.remove(node)

    # ------------------------------------------------------------ changes

    def apply_create(self, node: Node) -> list[Free]:
        """A new empty volume (or, with `node.parent` set, a clone of that snapshot)."""
        if node.parent is not None:
            node.cloned = True
            node.parent_limit = node.parent.blocks
            node.parent.children.append(node)
        self.add(node)
        return []

    def apply_delete_volume(self, number: int) -> list[Free]:
        """Forget a volume; its own blocks are freed (its snapshots keep theirs)."""
        node = self.node(number)
        self._remove(node)
        return _frees(node, (p for _, p in node.map.present()), discard=True)

    def apply_resize(self, number: int, size_bytes: int, update_ns: int) -> list[Free]:
        """Change a volume's size; a shrink drops (and hides) the blocks past the end."""
        node = self.node(number)
        keep = size_bytes // node.block_size
        dropped = []
        if keep < node.blocks:
            for block, phys in list(node.map.present(keep)):
                node.map.clear(block)
                dropped.append(phys)
            node.parent_limit = min(node.parent_limit, keep)
        node.size_bytes = size_bytes
        node.update_ns = update_ns
        return _frees(node, dropped, discard=True)

    def apply_write(self, number: int, first: int, entries: Iterable[Entry | None]) -> list[Free]:
        """Point blocks `first`, `first + 1`, ... at new data; frees what they replace.

        A None entry leaves its block as it is (recovery drops data that never landed).
        """
        node = self.node(number)
        bmap, bs = node.map, node.block_size
        frees = []
        block = first
        for entry in entries:
            if entry is not None:
                old = bmap.put(block, *entry)
                if old > ZERO:
                    frees.append((old, bs, False))
            block += 1
        return frees

    def apply_trim(self, number: int, first: int, count: int) -> list[Free]:
        """Blocks read as zeros again: dropped, or ZERO where a parent has data."""
        return self.trim(number, first, count)[0]

    def trim(self, number: int, first: int, count: int) -> tuple[list[Free], bool]:
        """`apply_trim`, and whether it changed anything (a block already trimmed does not)."""
        node = self.node(number)
        end = first + count
        shadowed = visible_in_parents(node, first, end)
        bmap = node.map
        own = list(bmap.present(first, end))
        freed = []
        changed = False
        for block, phys in own:
            if block not in shadowed:
                bmap.clear(block)
                freed.append(phys)
                changed = True
        zero = {block for block, phys in own if phys == ZERO}
        for block in shadowed - zero:
            freed.append(bmap.put(block, ZERO))
            changed = True
        return _frees(node, freed, discard=True), changed

    def apply_snapshot(self, number: int, snapshot: Node) -> list[Free]:
        """Freeze a volume: its map becomes the snapshot's, the volume starts a new one."""
        volume = self.node(number)
        snapshot.map = volume.map
        snapshot.parent = volume.parent
        snapshot.parent_limit = volume.parent_limit
        snapshot.cloned = volume.cloned
        snapshot.children = [volume]
        if volume.parent is not None:
            siblings = volume.parent.children
            siblings[siblings.index(volume)] = snapshot
        volume.map = BlockMap()
        volume.parent = snapshot
        volume.parent_limit = volume.blocks
        volume.cloned = False
        self.add(snapshot)
        return []

    def apply_delete_snapshot(self, number: int) -> list[Free]:
        """Forget a snapshot: merge it into the one map that depends on it, or free it."""
        snapshot = self.node(number)
        if any(c.cloned for c in snapshot.children) or len(snapshot.children) > 1:
            raise DataCorruption(f"snapshot {snapshot.name!r} cannot be deleted: it has clones")
        freed: list[int] = []
        if snapshot.children:
            (child,) = snapshot.children
            freed = _merge(snapshot, child)
            child.parent = snapshot.parent
            child.cloned = snapshot.cloned
            child.parent_limit = min(child.parent_limit, snapshot.parent_limit)
            snapshot.children = []
            if snapshot.parent is not None:
                siblings = snapshot.parent.children
                siblings[siblings.index(snapshot)] = child
                snapshot.parent = None
        else:
            freed = [p for _, p in snapshot.map.present()]
        self._remove(snapshot)
        return _frees(snapshot, freed, discard=True)

    def apply_qos(self, number: int, qos: QosLimits, update_ns: int) -> list[Free]:
        """Set a volume's QoS limits."""
        node = self.node(number)
        node.qos = qos
        node.update_ns = update_ns
        return []


def _frees(node: Node, phys: Iterable[int], *, discard: bool) -> list[Free]:
    bs = node.block_size
    return [(p, bs, discard) for p in phys if p > ZERO]


def _merge(snapshot: Node, child: Node) -> list[int]:
    """Move the snapshot's entries the child does not hide into the child; the rest is freed."""
    limit = child.parent_limit
    target = child.map
    freed: list[int] = []
    for index, chunk in sorted(snapshot.map.chunks.items()):
        base = index << CHUNK_SHIFT
        if base >= limit:
            freed.extend(p for p in chunk.phys if p)
            continue
        if index not in target.chunks and base + CHUNK_BLOCKS <= limit:
            target.adopt(index, chunk)
            continue
        for i in range(CHUNK_BLOCKS):
            phys = chunk.phys[i]
            if phys == ABSENT:
                continue
            block = base + i
            if block >= limit or target.get(block) != ABSENT:
                freed.append(phys)
            else:
                target.put(block, phys, chunk.meta[i], chunk.crc[i])
    snapshot.map = BlockMap()
    return freed
