"""The volume store engine: copy-on-write blocks in a shared pool, a metadata log.

`CowVolumeStore` implements `VolumeStore` over a `StoreMedia` (media.py): the file
backend gives it real files, the memory backend RAM, the crash tests a device that
loses unsynced writes. Its parts:

- `State` (state.py): volumes, snapshots and their block maps, changed only by
  `apply_*` calls that recovery replays identically;
- `SpaceMap` (space.py): free chunks and sectors of the pool, and the limbo where
  freed blocks wait until reuse is safe;
- `Journal` (journal.py): the metadata log with group commit, and checkpoints
  (checkpoint.py) that let the log be reused.

A write never touches a block a durable record points to. It takes free blocks,
writes the (encoded) data there, then, under the lock, points the volume's map at
them and appends a record (with each block's CRC32C, whatever the volume's data
services); the blocks the map pointed to before go to limbo with the record and are
reused only after the record is durable and no read still uses them. A FUA write or
a flush waits for its record's commit: one sync of the pool covers the data and the
log together. After a crash at any instant a block reads as its last content
acknowledged durable, or as a later write's whole content, never a mix: the old
blocks are intact until the new record is durable, and recovery ends the replay of
the last commit at the first write whose data does not match its CRC (that sync never
returned, so nothing from there on was acknowledged durable; see `_apply_commit`).

Durability of the other calls: create, resize, delete, trim, snapshot, clone and QoS
changes are durable when they return (they wait for their record's commit, shared
with everything else pending). A plain write is durable after the next flush, FUA
write or any of those calls; the journal's thread also commits within a second.

Locking: one lock (`_lock`) guards the state, the space map and the journal's pending
records; it is held for lookups, allocation and map updates, never across a data
write, a read or a sync. Reads and writes of the same volume run concurrently; a
write racing another to the same block ends with one of the two, whole.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import secrets
import threading
import time
from typing import TYPE_CHECKING, Final, Protocol

import crc32c

from dpu_agent.auth import DEFAULT_TENANT
from dpu_agent.errors import (
    AgentError,
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from dpu_agent.storage.backend import VolumeStore
from dpu_agent.storage.blockmap import FLAGS_SHIFT, LENGTH_MASK, ZERO, pack_meta
from dpu_agent.storage.checkpoint import SLOTS, Image, Loaded, capture, load_newest, persist
from dpu_agent.storage.dataservices import FLAG_ENCRYPTED, XTS_MIN_BYTES, BlockCodec, BlockRecord
from dpu_agent.storage.errors import DataCorruption
from dpu_agent.storage.journal import DEFAULT_CHECKPOINT_LOG_BYTES, Journal
from dpu_agent.storage.keys import check_key, generate_key
from dpu_agent.storage.layout import (
    CHUNK,
    CKPT_HEADER_BYTES,
    FIRST_DATA_CHUNK,
    MAX_WRITE_ENTRIES,
    SECTOR,
    SECTORS_PER_CHUNK,
    LogPosition,
    batch_of,
    parse_log_block,
    pool_header,
    pool_header_valid,
    write_record,
)
from dpu_agent.storage.layout import records as log_records
from dpu_agent.storage.qos import NO_WAIT, OPS, Reservation, VolumeQos, check_qos
from dpu_agent.storage.records import (
    check_write,
    create_record,
    delete_snapshot_record,
    delete_volume_record,
    qos_record,
    replay,
    resize_record,
    snapshot_record,
    trim_record,
)
from dpu_agent.storage.space import SpaceMap
from dpu_agent.storage.state import (
    SNAPSHOT,
    VOLUME,
    Node,
    State,
    clone_volumes,
    next_to_trim,
    resolve,
)
from dpu_agent.storage.stats import StatsCounter
from dpu_agent.storage.types import (
    BLOCK_SIZES,
    NO_QOS,
    Encryption,
    QosLimits,
    SnapshotInfo,
    VolumeInfo,
)
from dpu_agent.storage.validate import (
    as_byte_view,
    check_block_size,
    check_fits,
    check_range_in,
    check_services,
    check_size,
    check_snapshot_id,
    check_volume_id,
)

if TYPE_CHECKING:
    import builtins
    from collections.abc import Iterator, Sequence

    from dpu_agent.storage.backend import BatchedWrite
    from dpu_agent.storage.blockmap import Entry
    from dpu_agent.storage.keys import KeySealer
    from dpu_agent.storage.media import StoreFile, StoreMedia
    from dpu_agent.storage.types import DataServices, VolumeStats

log = logging.getLogger(__name__)

DEFAULT_MAX_VOLUME_BYTES: Final = 1 << 40  # 1 TiB
POOL: Final = "pool"
# Maps a read may walk (a volume, its snapshots, the snapshots its clone came from):
# bounds the cost of a lookup and the snapshots a tenant can pile up on one volume.
MAX_CHAIN_DEPTH: Final = 64
TRIM_SLICE_BLOCKS: Final = 1 << 12  # blocks a trim looks at per hold of the lock (`trim`)
_WRITE_RECORD_BYTES: Final = 16  # per block in a write record
_IOV_MAX: Final = 512  # buffers per vectored write (Linux takes 1024)
_ZEROS: Final = memoryview(bytes(max(BLOCK_SIZES)))  # padding after a short (compressed) block


class LegacySource(Protocol):
    """A store in an older format, to be copied into a new one (legacy.py)."""

    def volumes(self) -> builtins.list[tuple[VolumeInfo, bytes | None]]:
        """Every volume with its sealed key."""

    def blocks(self, info: VolumeInfo) -> Iterator[tuple[int, bytes, int, int, int | None]]:
        """(block, stored bytes, length, flags, crc) of each written block."""

    def remove(self) -> None:
        """Delete the old format's files (after the new store is durable)."""


class _Volume:
    """The runtime side of a volume: counters, QoS buckets, its codec and key."""

    __slots__ = ("codec", "deleted", "key", "node", "qos", "stats")

    def __init__(self, node: Node) -> None:
        self.node = node
        self.codec: BlockCodec | None = None
        self.key: bytes | None = None
        self.stats = StatsCounter()
        self.qos = VolumeQos(node.qos)
        self.deleted = False

    def __repr__(self) -> str:
        return f"_Volume({self.node.name!r})"


class _OsErrors:
    """`with os_errors():` turns OSError from the backing storage into domain errors.

    A class, not `contextlib.contextmanager`: it is on every read's and write's path,
    and a generator-based manager costs five times as much (0.5 against 0.1 us).
    """

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        if not isinstance(exc, OSError):
            return
        reason = exc.strerror or type(exc).__name__
        if exc.errno in {errno.ENOSPC, errno.EDQUOT}:
            raise ResourceExhausted(f"no space left for volume data: {reason}") from exc
        if exc.errno == errno.EIO:
            raise DataCorruption(f"the volume's storage reported an I/O error: {reason}") from exc
        raise Unavailable(f"volume storage failed: {reason}") from exc


_OS_ERRORS: Final = _OsErrors()


def os_errors() -> _OsErrors:
    """The context manager that maps OSError to domain errors (`_OsErrors`)."""
    return _OS_ERRORS


def _raise_first(errors: builtins.list[AgentError | None]) -> None:
    for error in errors:
        if error is not None:
            raise error


def _key_name(node: Node) -> str:
    """What a node's sealed key is bound to (volume ids and snapshot names never clash)."""
    return node.name if node.kind == VOLUME else f"snapshots/{node.name}"


def _runs(sectors: builtins.list[int], step: int) -> Iterator[tuple[int, int]]:
    """(index, count) of runs of consecutive sectors (`step` apart)."""
    start = 0
    for i in range(1, len(sectors) + 1):
        if i == len(sectors) or sectors[i] != sectors[i - 1] + step:
            yield start, i - start
            start = i


class CowVolumeStore(VolumeStore):
    """A VolumeStore of copy-on-write volumes, snapshots and clones (see the module doc).

    Space policy: volumes are thin; a volume, clone or growth is refused when it is
    larger than the space free at that moment (`_free_bytes`: the media's free space
    and the pool's free chunks, or `capacity_bytes` minus what is used). Nothing is
    reserved, so volumes together may promise more than there is; a write that finds
    no space fails with ResourceExhausted and changes nothing.
    """

    def __init__(  # noqa: PLR0913 - the media, the key sealer and the tunables
        self,
        media: StoreMedia,
        sealer: KeySealer,
        *,
        max_volume_bytes: int = DEFAULT_MAX_VOLUME_BYTES,
        capacity_bytes: int | None = None,
        checkpoint_log_bytes: int = DEFAULT_CHECKPOINT_LOG_BYTES,
        legacy: LegacySource | None = None,
    ) -> None:
        if max_volume_bytes <= 0:
            raise InvalidArgument(f"max_volume_bytes {max_volume_bytes} is not positive")
        self._media = media
        self._sealer = sealer
        self._max_volume_bytes = max_volume_bytes
        self._capacity = capacity_bytes
        self._checkpoint_log_bytes = checkpoint_log_bytes
        self._lock = threading.Lock()
        self._closed = False
        self._volumes: dict[str, _Volume] = {}
        self._ckpt_number = 0
        self._pool: StoreFile = media.open(POOL)
        self._slots = [media.open(name) for name in SLOTS]
        try:
            with os_errors():
                self._open(legacy)
        except BaseException:
            self._close_files()
            raise
        self._journal.start()

    def __repr__(self) -> str:
        return f"CowVolumeStore({self._media!r})"

    @property
    def max_volume_bytes(self) -> int:
        """The largest volume this store creates."""
        return self._max_volume_bytes

    # ------------------------------------------------------------ opening

    def _open(self, legacy: LegacySource | None) -> None:
        header_ok = pool_header_valid(self._pool.pread(CHUNK, 0))
        loaded = load_newest(self._slots)
        if not header_ok:
            # a new store, or one whose format never finished: nothing in it to keep
            empty = self._fresh(loaded) if loaded is not None else self._pool.size() == 0
            if legacy is None and not empty:
                raise DataCorruption(
                    "the volume pool's header is damaged but the store holds volumes; "
                    "refusing to format over them"
                )
            self._format(legacy)
            return
        if loaded is None:
            raise DataCorruption("the volume store has no valid checkpoint")
        if legacy is not None:  # a migration finished; its leftovers go now
            legacy.remove()
        self._ckpt_number = loaded.number
        state = loaded.state
        end, live, salt, pinned = self._replay(state, loaded.position)
        position = LogPosition(end.head, end.seq, _new_salt(), salt)
        self._setup(state, self._rebuild_space(state, live, end.head, pinned), position, live)
        log.info(
            "volume store open",
            extra={
                "volumes": len(state.volumes),
                "snapshots": len(state.snapshots),
                "checkpoint": loaded.number,
                "log_blocks_replayed": len(live),
            },
        )

    def _fresh(self, loaded: Loaded) -> bool:
        """True if the checkpoint is the empty first one and nothing was logged after it."""
        if loaded.number != 1 or loaded.state.nodes:
            return False
        first = parse_log_block(self._pool.pread(CHUNK, loaded.position.head * SECTOR))
        return first is None or first[2] != loaded.position.seq

    def _format(self, legacy: LegacySource | None) -> None:
        """A new, empty store (then the old format's volumes copied in, if any)."""
        for slot in self._slots:  # no checkpoint of an earlier attempt may count
            slot.pwrite(bytes(CKPT_HEADER_BYTES), 0)
            slot.sync()
        state = State()
        head = FIRST_DATA_CHUNK * SECTORS_PER_CHUNK
        salt = _new_salt()
        position = LogPosition(head, 1, salt, salt)
        self._ckpt_number = 1
        persist(self._slots[1], Image(1, position, state.next_node, []))
        self._setup(state, SpaceMap.rebuild([FIRST_DATA_CHUNK], [], []), position, [])
        if legacy is not None:
            self._import(legacy)
            self._journal.checkpoint_now()
        self._pool.pwrite(pool_header(), 0)
        self._pool.sync()
        if legacy is not None:
            legacy.remove()
        log.info("volume store formatted", extra={"migrated": legacy is not None})

    def _setup(
        self,
        state: State,
        space: SpaceMap,
        position: LogPosition,
        live: builtins.list[tuple[int, int]],
    ) -> None:
        self._state = state
        self._space = space
        self._journal = Journal(
            self._pool,
            self._lock,
            space,
            position,
            capture=self._capture,
            persist=self._persist,
            checkpoint_log_bytes=self._checkpoint_log_bytes,
            live_blocks=live,
        )
        self._volumes = {name: _Volume(node) for name, node in state.volumes.items()}

    def _replay(
        self, state: State, start: LogPosition
    ) -> tuple[LogPosition, builtins.list[tuple[int, int]], int, builtins.list[tuple[int, int]]]:
        """Apply the log after the checkpoint.

        Returns where it ends, its blocks, its salt, and the space to pin (see
        `_apply_commit`).
        """
        sector, seq, salt = start.head, start.seq, start.prev_salt
        live = []
        pinned: builtins.list[tuple[int, int]] = []
        commit: builtins.list[memoryview] = []  # the payloads of the commit being read
        while True:
            parsed = parse_log_block(self._pool.pread(CHUNK, sector * SECTOR))
            # the next block of this era, or the first block of the next era; anything
            # else was written in an era that recovery has already cut off
            if parsed is None or parsed[2] != seq or parsed[1] != salt:
                pinned += self._apply_commit(state, commit, last=True)
                break
            block_salt, _, _, nxt, payload = parsed
            if block_salt != salt:  # a new era: the commit before was the last of its era
                pinned += self._apply_commit(state, commit, last=True)
                commit = []
            elif batch_of(payload) in {None, seq}:  # a new commit (or a block from before
                self._apply_commit(state, commit, last=False)  # BATCH records: its own)
                commit = []
            commit.append(payload)
            live.append((seq, sector))
            salt, sector, seq = block_salt, nxt, seq + 1
        return LogPosition(sector, seq, salt, salt), live, salt, pinned

    def _apply_commit(
        self, state: State, payloads: builtins.list[memoryview], *, last: bool
    ) -> builtins.list[tuple[int, int]]:
        """Replay the records of one commit (one sync).

        Commits are made one after another: a block of a later commit on disk means this
        one's sync returned, and its data is on disk. A write record whose data does not
        match its CRC then lost a block to a later change that freed and reused it; the
        block's later record follows, so that entry alone is skipped. In the last
        commit of an era (`last`) the sync may never have returned: there a write whose
        data did not land ends the replay of the commit. Nothing from it on was
        acknowledged durable, and applying what follows it (a snapshot, say) would
        record a state in which that write never happened though it was acknowledged
        before them. (That holds because space a commit frees that its own writes point
        to is reused only once a later commit is durable; a log from before BATCH
        records, written when it was reused at once, is replayed entry by entry
        throughout.)

        Returns, for a last commit, the space its writes name up to where its replay
        ended, as (sector, block size): the store pins it (never reuses it) until the
        next open. Until a checkpoint covers this commit, every recovery judges it again,
        and must judge it the same way: a write applied now must still match its data
        then, and the one that ended the replay must still not.
        """
        verify = self._verify
        last = last and bool(payloads) and batch_of(payloads[0]) is not None
        pinned: builtins.list[tuple[int, int]] = []
        for payload in payloads:
            for kind, body in log_records(payload):
                if not last:
                    replay(state, kind, body, verify)
                    continue
                intact, blocks = check_write(state, kind, body, verify)
                pinned += blocks
                if not intact:
                    log.warning(
                        "recovery dropped the end of the last commit before the crash: "
                        "the data of a write in it never reached the disk"
                    )
                    return pinned
                replay(state, kind, body)  # its data was checked just above
        return pinned

    def _verify(self, node: Node, _block: int, entry: Entry) -> bool:
        """True if the data an entry points to matches its CRC (recovery)."""
        phys, meta, crc = entry
        length, flags = meta & LENGTH_MASK, meta >> FLAGS_SHIFT
        stored = max(length, XTS_MIN_BYTES) if flags & FLAG_ENCRYPTED else length
        if phys <= ZERO or not 0 < stored <= node.block_size:
            return False
        return bool(crc32c.crc32c(self._pool.pread(stored, phys * SECTOR)) == crc)

    def _rebuild_space(
        self,
        state: State,
        live: builtins.list[tuple[int, int]],
        head: int,
        pinned: builtins.list[tuple[int, int]],
    ) -> SpaceMap:
        chunks = {sector // SECTORS_PER_CHUNK for _, sector in live}
        chunks.add(head // SECTORS_PER_CHUNK)
        sectors: set[int] = set()
        for node in state.nodes.values():
            small = node.block_size != CHUNK
            for chunk in node.map.chunks.values():
                used = [p for p in chunk.phys if p > ZERO]
                if small:
                    sectors.update(used)
                else:
                    chunks.update(p // SECTORS_PER_CHUNK for p in used)
        for sector, block_size in pinned:
            if block_size == CHUNK:
                chunks.add(sector // SECTORS_PER_CHUNK)
            else:
                sectors.add(sector)
        space = SpaceMap.rebuild(chunks, sectors, self._pool.data_ranges())
        space.pin(sector for sector, _ in pinned)
        return space

    def _import(self, legacy: LegacySource) -> None:
        """Copy the volumes of an older store in (their stored bytes, keys and records)."""
        for info, sealed in legacy.volumes():
            with self._lock:
                node = Node(
                    self._state.next_node,
                    VOLUME,
                    info.volume_id,
                    info.tenant,
                    info.size_bytes,
                    info.block_size,
                    info.services,
                    info.create_ns,
                    info.update_ns,
                    sealed,
                )
                self._state.apply_create(node)
                self._journal.append(create_record(node), [])
                if info.update_ns != info.create_ns:
                    self._state.apply_resize(node.node, info.size_bytes, info.update_ns)
                    self._journal.append(
                        resize_record(node.node, info.size_bytes, info.update_ns), []
                    )
                self._volumes[info.volume_id] = _Volume(node)
            batch: builtins.list[tuple[int, Entry]] = []
            for block, stored, length, flags, crc in legacy.blocks(info):
                with self._lock:
                    (sector,) = self._space.alloc(1, info.block_size)
                self._pool.pwrite(stored, sector * SECTOR)
                batch.append(
                    (
                        block,
                        (
                            sector,
                            pack_meta(length, flags),
                            crc32c.crc32c(stored) if crc is None else crc,
                        ),
                    )
                )
                if len(batch) >= 4096:
                    self._import_entries(node, batch)
                    batch = []
            self._import_entries(node, batch)
            log.info(
                "migrated a volume to the new store format", extra={"volume_id": info.volume_id}
            )

    def _import_entries(self, node: Node, batch: builtins.list[tuple[int, Entry]]) -> None:
        with self._lock:
            for block, entry in batch:
                self._journal.reserve(64)
                self._state.apply_write(node.node, block, [entry])
                self._journal.append(
                    write_record(node.node, block, [entry]), [], 1, written=(entry[0],)
                )
        self._journal.wait(self._journal.appended)

    # ------------------------------------------------------------ checkpoints

    def _capture(self, position: LogPosition) -> Image:
        return capture(self._state, self._ckpt_number + 1, position)

    def _persist(self, image: Image) -> int:
        size = persist(self._slots[image.number % 2], image)
        self._ckpt_number = image.number
        return size

    # ------------------------------------------------------------ volumes

    def create(  # noqa: PLR0913 - a volume's settings and its owner
        self,
        volume_id: str,
        size_bytes: int,
        block_size: int,
        services: DataServices,
        key: bytes | None = None,
        *,
        tenant: str = DEFAULT_TENANT,
        qos: QosLimits | None = None,
    ) -> VolumeInfo:
        """See `VolumeStore.create`."""
        volume_id = check_volume_id(volume_id)
        block_size = check_block_size(block_size)
        services = check_services(services)
        size_bytes = check_size(size_bytes, block_size, self._max_volume_bytes)
        qos = check_qos(NO_QOS if qos is None else qos)
        raw_key: bytes | None = None
        if services.encryption is Encryption.NONE:
            if key is not None:
                raise InvalidArgument("an encryption key was given for a volume without encryption")
        else:
            raw_key = check_key(key) if key is not None else generate_key()
        sealed = None if raw_key is None else self._sealer.seal(volume_id, raw_key)
        now = time.time_ns()
        with self._lock:
            self._check_open()
            if volume_id in self._state.volumes:
                raise AlreadyExists(f"volume {volume_id!r} already exists")
            with os_errors():
                check_fits(size_bytes, self._free_bytes())
                promise = self._journal.reserve(512)
            node = Node(
                self._state.next_node,
                VOLUME,
                volume_id,
                tenant,
                size_bytes,
                block_size,
                services,
                now,
                now,
                sealed,
                qos,
            )
            self._state.apply_create(node)
            seq = self._journal.append(create_record(node), [], promise)
            vol = self._volumes[volume_id] = _Volume(node)
            vol.key = raw_key
        self._journal.wait(seq)
        log.info(
            "created volume",
            extra={
                "volume_id": volume_id,
                "size_bytes": size_bytes,
                "block_size": block_size,
                "crc32c": services.crc32c,
                "compression": str(services.compression),
                "encryption": str(services.encryption),
                "tenant": tenant,
            },
        )
        return node.volume_info()

    def get(self, volume_id: str) -> VolumeInfo:
        """See `VolumeStore.get`."""
        return self._volume(volume_id).node.volume_info()

    def list(self, tenant: str | None = None) -> builtins.list[VolumeInfo]:
        """See `VolumeStore.list`.

        A tenant's volumes come from the state's index by tenant: the lock is held
        for the walk, and the data plane waits for it.
        """
        with self._lock:
            self._check_open()
            nodes = self._state.volumes if tenant is None else self._state.of(tenant, VOLUME)
            return [nodes[v].volume_info() for v in sorted(nodes)]

    def resize(self, volume_id: str, size_bytes: int, *, force: bool = False) -> VolumeInfo:
        """See `VolumeStore.resize`."""
        vol = self._volume(volume_id)
        node = vol.node
        size = check_size(size_bytes, node.block_size, self._max_volume_bytes)
        with self._lock:
            self._check_live(vol)
            if size == node.size_bytes:
                return node.volume_info()
            shrink = size < node.size_bytes
            with os_errors():
                if not shrink:
                    check_fits(size - node.size_bytes, self._free_bytes())
                elif not force and self._has_data_from(node, size // node.block_size):
                    raise FailedPrecondition(
                        f"volume {volume_id!r} holds data past {size} bytes; "
                        "shrinking would drop it (use force)"
                    )
                promise = self._journal.reserve(64, emergency=shrink)
            now = time.time_ns()
            frees = self._state.apply_resize(node.node, size, now)
            seq = self._journal.append(resize_record(node.node, size, now), frees, promise)
            info = node.volume_info()
        self._journal.wait(seq)
        if frees:
            self._journal.release_frees(seq)  # the space is back when a shrink returns
        log.info("resized volume", extra={"volume_id": volume_id, "size_bytes": size})
        return info

    def _has_data_from(self, node: Node, keep: int) -> bool:
        if node.map.has_data_from(keep):
            return True
        parent, limit = node.parent, node.parent_limit
        while parent is not None and keep < limit:
            for block, _ in parent.map.present(keep, limit):
                if resolve(node, block) is not None:
                    return True
            limit = min(limit, parent.parent_limit)
            parent = parent.parent
        return False

    def delete(self, volume_id: str) -> None:
        """See `VolumeStore.delete`."""
        volume_id = check_volume_id(volume_id)
        with self._lock:
            self._check_open()
            vol = self._volumes.get(volume_id)
            if vol is None:
                raise NotFound(f"volume {volume_id!r} does not exist")
            with os_errors():
                promise = self._journal.reserve(64, emergency=True)
            frees = self._state.apply_delete_volume(vol.node.node)
            seq = self._journal.append(delete_volume_record(vol.node.node), frees, promise)
            vol.deleted = True
            vol.codec = vol.key = None
            del self._volumes[volume_id]
        self._journal.wait(seq)
        self._journal.release_frees(seq)
        log.info("deleted volume", extra={"volume_id": volume_id})

    def set_qos(self, volume_id: str, qos: QosLimits) -> VolumeInfo:
        """See `VolumeStore.set_qos`."""
        qos = check_qos(qos)
        vol = self._volume(volume_id)
        with self._lock:
            self._check_live(vol)
            with os_errors():
                promise = self._journal.reserve(64)
            now = time.time_ns()
            self._state.apply_qos(vol.node.node, qos, now)
            seq = self._journal.append(qos_record(vol.node.node, qos, now), [], promise)
            vol.qos.set(qos)
            info = vol.node.volume_info()
        self._journal.wait(seq)
        log.info("set volume qos", extra={"volume_id": volume_id, **dataclasses.asdict(qos)})
        return info

    def throttle(self, volume_id: str, op: str, nbytes: int) -> Reservation:
        """See `VolumeStore.throttle`."""
        if op not in OPS:
            raise InvalidArgument(f"op must be one of {', '.join(OPS)}, not {op!r}")
        vol = self._volumes.get(volume_id)
        return NO_WAIT if vol is None else vol.qos.throttle(op, nbytes)

    # ------------------------------------------------------------ snapshots and clones

    def create_snapshot(self, volume_id: str, snapshot_id: str) -> SnapshotInfo:
        """See `VolumeStore.create_snapshot`."""
        snapshot_id = check_snapshot_id(snapshot_id)
        vol = self._volume(volume_id)
        key = self._key(vol)
        sealed = None if key is None else self._sealer.seal(f"snapshots/{snapshot_id}", key)
        now = time.time_ns()
        with self._lock:
            self._check_live(vol)
            node = vol.node
            if snapshot_id in self._state.snapshots:
                raise AlreadyExists(f"snapshot {snapshot_id!r} already exists")
            if node.depth() >= MAX_CHAIN_DEPTH:
                raise FailedPrecondition(
                    f"volume {volume_id!r} has {MAX_CHAIN_DEPTH - 1} snapshots in its chain "
                    "(the most a volume may have); delete old ones first"
                )
            with os_errors():
                promise = self._journal.reserve(512)
            snap = Node(
                self._state.next_node,
                SNAPSHOT,
                snapshot_id,
                node.tenant,
                node.size_bytes,
                node.block_size,
                node.services,
                now,
                now,
                sealed,
                source=node.name,
            )
            self._state.apply_snapshot(node.node, snap)
            seq = self._journal.append(snapshot_record(node.node, snap), [], promise)
            info = snap.snapshot_info()
        self._journal.wait(seq)
        log.info("created snapshot", extra={"snapshot_id": snapshot_id, "volume_id": volume_id})
        return info

    def get_snapshot(self, snapshot_id: str) -> SnapshotInfo:
        """See `VolumeStore.get_snapshot`."""
        snapshot_id = check_snapshot_id(snapshot_id)
        with self._lock:
            self._check_open()
            return self._snapshot(snapshot_id).snapshot_info()

    def list_snapshots(self, tenant: str | None = None) -> builtins.list[SnapshotInfo]:
        """See `VolumeStore.list_snapshots` (a tenant's from the index, as in `list`)."""
        with self._lock:
            self._check_open()
            snaps = self._state.snapshots if tenant is None else self._state.of(tenant, SNAPSHOT)
            return [snaps[s].snapshot_info() for s in sorted(snaps)]

    def delete_snapshot(self, snapshot_id: str) -> None:
        """See `VolumeStore.delete_snapshot`."""
        snapshot_id = check_snapshot_id(snapshot_id)
        with self._lock:
            self._check_open()
            snap = self._snapshot(snapshot_id)
            if any(child.cloned for child in snap.children):
                clones = clone_volumes(snap)
                raise FailedPrecondition(
                    f"snapshot {snapshot_id!r} has clones"
                    + (f" ({', '.join(sorted(clones))})" if clones else " (snapshots of them)")
                    + "; delete them first"
                )
            with os_errors():
                promise = self._journal.reserve(64, emergency=True)
            frees = self._state.apply_delete_snapshot(snap.node)
            seq = self._journal.append(delete_snapshot_record(snap.node), frees, promise)
        self._journal.wait(seq)
        self._journal.release_frees(seq)
        log.info("deleted snapshot", extra={"snapshot_id": snapshot_id})

    def clone(
        self,
        snapshot_id: str,
        volume_id: str,
        size_bytes: int = 0,
        *,
        tenant: str | None = None,
        qos: QosLimits | None = None,
    ) -> VolumeInfo:
        """See `VolumeStore.clone`."""
        snapshot_id = check_snapshot_id(snapshot_id)
        volume_id = check_volume_id(volume_id)
        qos = check_qos(NO_QOS if qos is None else qos)
        with self._lock:
            self._check_open()
            snap = self._snapshot(snapshot_id)
        size = size_bytes or snap.size_bytes
        size = check_size(size, snap.block_size, self._max_volume_bytes)
        if size < snap.size_bytes:
            raise InvalidArgument(
                f"size_bytes {size} is smaller than snapshot {snapshot_id!r} ({snap.size_bytes})"
            )
        sealed = None
        if snap.sealed_key is not None:
            key = self._sealer.unseal(_key_name(snap), snap.sealed_key)
            sealed = self._sealer.seal(volume_id, key)
        now = time.time_ns()
        with self._lock:
            self._check_open()
            if self._state.snapshots.get(snapshot_id) is not snap:
                raise NotFound(f"snapshot {snapshot_id!r} does not exist")
            if volume_id in self._state.volumes:
                raise AlreadyExists(f"volume {volume_id!r} already exists")
            if snap.depth() >= MAX_CHAIN_DEPTH:
                raise FailedPrecondition(
                    f"snapshot {snapshot_id!r} is {snap.depth()} maps deep; a clone of it would "
                    f"be deeper than {MAX_CHAIN_DEPTH}"
                )
            with os_errors():
                check_fits(size, self._free_bytes())
                promise = self._journal.reserve(512)
            node = Node(
                self._state.next_node,
                VOLUME,
                volume_id,
                snap.tenant if tenant is None else tenant,
                size,
                snap.block_size,
                snap.services,
                now,
                now,
                sealed,
                qos,
                source=snap.name,
                parent=snap,
            )
            self._state.apply_create(node)
            seq = self._journal.append(create_record(node), [], promise)
            self._volumes[volume_id] = _Volume(node)
        self._journal.wait(seq)
        log.info("cloned volume", extra={"volume_id": volume_id, "snapshot_id": snapshot_id})
        return node.volume_info()

    # ------------------------------------------------------------ I/O

    def read(self, volume_id: str, offset: int, length: int) -> bytes:
        """See `VolumeStore.read`."""
        start = time.perf_counter()
        vol = self._volume(volume_id)
        try:
            node = vol.node
            bs = node.block_size
            first, count = check_range_in(node.size_bytes, bs, offset, length)
            codec = vol.codec or self._codec(vol)
            space = self._space
            with self._lock:
                self._check_live(vol)
                if first + count > node.blocks:  # shrunk meanwhile
                    check_range_in(node.size_bytes, bs, offset, length)
                if count == 1:
                    entries = [resolve(node, first)]
                else:
                    entries = [resolve(node, b) for b in range(first, first + count)]
                epoch = space.reader_enter()
            try:
                with os_errors():
                    data = self._fetch(codec, bs, first, entries)
            finally:
                with self._lock:
                    discards = space.reclaim() if space.reader_exit(epoch) else []
                if discards:
                    self._journal.discard(discards)
        except DataCorruption as exc:
            vol.stats.error()
            log.warning("data corruption", extra={"volume_id": volume_id, "error": str(exc)})
            raise
        except BaseException:
            vol.stats.error()
            raise
        vol.stats.read(length, time.perf_counter() - start)
        return data

    def _fetch(
        self, codec: BlockCodec, bs: int, first: int, entries: builtins.list[Entry | None]
    ) -> bytes:
        if len(entries) == 1:
            entry = entries[0]
            if entry is None:
                return bytes(bs)
            raw = self._pool.pread(bs, entry[0] * SECTOR)
            if codec.transparent:
                return raw
            return bytes(self._decode(codec, first, memoryview(raw), entry))
        buf = self._read_runs(bs, entries)
        if not codec.transparent:
            view = memoryview(buf)
            for i, entry in enumerate(entries):
                if entry is not None:
                    slot = view[i * bs : (i + 1) * bs]
                    decoded = self._decode(codec, first + i, slot, entry)
                    if not codec.stores_plain:
                        slot[:] = decoded
        return bytes(buf)

    def _read_runs(self, bs: int, entries: builtins.list[Entry | None]) -> bytearray:
        """The blocks' stored bytes (zeros where None), one pread per run stored back to back."""
        buf = bytearray(len(entries) * bs)
        step = bs // SECTOR
        i, n = 0, len(entries)
        while i < n:
            entry = entries[i]
            if entry is None:
                i += 1
                continue
            j = i + 1
            while j < n and (e := entries[j]) is not None and e[0] == entry[0] + (j - i) * step:
                j += 1
            buf[i * bs : j * bs] = self._pool.pread((j - i) * bs, entry[0] * SECTOR)
            i = j
        return buf

    @staticmethod
    def _decode(
        codec: BlockCodec, block: int, slot: memoryview, entry: Entry
    ) -> bytes | memoryview:
        _, meta, crc = entry
        return codec.decode(block, slot, BlockRecord(meta & LENGTH_MASK, meta >> FLAGS_SHIFT, crc))

    def write(
        self, volume_id: str, offset: int, data: bytes | memoryview, *, fua: bool = False
    ) -> None:
        """See `VolumeStore.write`."""
        start = time.perf_counter()
        vol = self._volume(volume_id)
        try:
            view = as_byte_view(data)
            length = view.nbytes
            node = vol.node
            bs = node.block_size
            first, count = check_range_in(node.size_bytes, bs, offset, length)
            codec = vol.codec or self._codec(vol)
            with os_errors():
                seq, errors = self._write_items(vol, codec, [(first, count, view)])
                _raise_first(errors)
                if fua:
                    self._journal.wait(seq)
        except DataCorruption as exc:
            vol.stats.error()
            log.warning("data corruption", extra={"volume_id": volume_id, "error": str(exc)})
            raise
        except BaseException:
            vol.stats.error()
            raise
        vol.stats.write(length, time.perf_counter() - start)

    def write_batch(self, writes: Sequence[BatchedWrite]) -> builtins.list[AgentError | None]:
        """See `VolumeStore.write_batch`.

        Each run of writes to one volume shares one allocation, one log reservation and
        one pass under the lock.
        """
        results: builtins.list[AgentError | None] = [None] * len(writes)
        start = 0
        while start < len(writes):
            end = start + 1
            while end < len(writes) and writes[end][0] == writes[start][0]:
                end += 1
            self._write_run(writes, range(start, end), results)
            start = end
        return results

    def _write_run(
        self,
        writes: Sequence[BatchedWrite],
        indexes: range,
        results: builtins.list[AgentError | None],
    ) -> None:
        """`write_batch` for `writes[indexes]`, all to one volume: errors into `results`."""
        start = time.perf_counter()
        volume_id = writes[indexes[0]][0]
        try:
            vol = self._volume(volume_id)
        except AgentError as exc:
            for i in indexes:
                results[i] = exc
            return
        items, where = self._checked(vol, writes, indexes, results)
        if not items:
            return
        errors: builtins.list[AgentError | None]
        try:
            codec = vol.codec or self._codec(vol)
            with os_errors():
                _, errors = self._write_items(vol, codec, items)
        except AgentError as exc:
            if isinstance(exc, DataCorruption):
                log.warning("data corruption", extra={"volume_id": volume_id, "error": str(exc)})
            errors = [exc] * len(items)
        count = nbytes = 0
        for i, (_, _, view), error in zip(where, items, errors, strict=True):
            results[i] = error
            if error is None:
                count += 1
                nbytes += view.nbytes
            else:
                vol.stats.error()
        if count:  # the batch's time counts as each write's latency
            vol.stats.write(nbytes, time.perf_counter() - start, count)

    @staticmethod
    def _checked(
        vol: _Volume,
        writes: Sequence[BatchedWrite],
        indexes: range,
        results: builtins.list[AgentError | None],
    ) -> tuple[builtins.list[tuple[int, int, memoryview]], builtins.list[int]]:
        """The writes with a valid range, as (first block, count, data), and their indexes.

        The others' errors go into `results`.
        """
        node = vol.node
        items: builtins.list[tuple[int, int, memoryview]] = []
        where: builtins.list[int] = []
        for i in indexes:
            try:
                view = as_byte_view(writes[i][2])
                first, count = check_range_in(
                    node.size_bytes, node.block_size, writes[i][1], view.nbytes
                )
            except AgentError as exc:
                results[i] = exc
                vol.stats.error()
                continue
            items.append((first, count, view))
            where.append(i)
        return items, where

    @staticmethod
    def _encode(
        codec: BlockCodec, bs: int, first: int, count: int, view: memoryview
    ) -> tuple[builtins.list[bytes | memoryview] | None, builtins.list[int], builtins.list[int]]:
        """(payloads, or None when the data goes as it is; metas; CRCs) of `count` blocks."""
        if codec.transparent:
            crcs = [crc32c.crc32c(view[i * bs : (i + 1) * bs]) for i in range(count)]
            return None, [pack_meta(bs, 0)] * count, crcs
        payloads: builtins.list[bytes | memoryview] = []
        metas, crcs = [], []
        for i in range(count):
            payload, rec = codec.encode(first + i, view[i * bs : (i + 1) * bs])
            payloads.append(payload)
            metas.append(pack_meta(rec.length, rec.flags))
            crcs.append(crc32c.crc32c(payload) if rec.crc is None else rec.crc)
        return payloads, metas, crcs

    def _write_items(
        self, vol: _Volume, codec: BlockCodec, items: builtins.list[tuple[int, int, memoryview]]
    ) -> tuple[int, builtins.list[AgentError | None]]:
        """Write `items` ((first block, count, data) each, in order) copy-on-write.

        Their data goes to newly allocated space first; then, under the lock, each one's
        records are applied and logged. One allocation and one log reservation serve them
        all. Returns the last record's number (for `Journal.wait`) and each item's error:
        only a write the volume was shrunk under fails alone; anything else raises.
        """
        node = vol.node
        bs = node.block_size
        encoded: builtins.list[tuple[builtins.list[int], builtins.list[int]]] = []
        pieces: builtins.list[tuple[bytes | memoryview, int]] = []
        total = record_bytes = 0
        for first, count, view in items:
            payloads, metas, crcs = self._encode(codec, bs, first, count, view)
            encoded.append((metas, crcs))
            if payloads is None:
                pieces.append((view, count))
            else:
                pieces.extend([(payload, 1) for payload in payloads])
            total += count
            record_bytes += count * _WRITE_RECORD_BYTES + 20 * (1 + count // MAX_WRITE_ENTRIES)
        with self._lock:
            self._check_live(vol)
            self._journal.check()
            sectors = self._space.alloc(total, bs)
            try:
                promise = self._journal.reserve(record_bytes)
            except BaseException:
                self._space.release(sectors, bs, backed=False)
                raise
        try:
            self._put_data(bs, sectors, pieces)
        except BaseException:
            with self._lock:
                self._space.release(sectors, bs, backed=False)
                self._journal.unreserve(promise)
            raise
        return self._commit(vol, items, encoded, sectors, promise)

    def _commit(
        self,
        vol: _Volume,
        items: builtins.list[tuple[int, int, memoryview]],
        encoded: builtins.list[tuple[builtins.list[int], builtins.list[int]]],
        sectors: builtins.list[int],
        promise: int,
    ) -> tuple[int, builtins.list[AgentError | None]]:
        """`_write_items`' second half: point the blocks at their new sectors and log it."""
        node = vol.node
        bs = node.block_size
        errors: builtins.list[AgentError | None] = [None] * len(items)
        with self._lock:
            if vol.deleted:
                self._space.release(sectors, bs, backed=True)
                self._journal.unreserve(promise)
                self._check_live(vol)
            state, journal = self._state, self._journal
            seq = 0
            at = 0
            for index, (first, count, _) in enumerate(items):
                metas, crcs = encoded[index]
                mine = sectors[at : at + count] if len(items) > 1 else sectors
                at += count
                if first + count > node.blocks:  # shrunk meanwhile
                    self._space.release(mine, bs, backed=True)
                    errors[index] = InvalidArgument(
                        f"the write past {first * bs} bytes is past the end of the volume "
                        f"({node.size_bytes} bytes): it was shrunk meanwhile"
                    )
                    continue
                entries = list(zip(mine, metas, crcs, strict=True))
                for part_at in range(0, count, MAX_WRITE_ENTRIES):
                    part = entries[part_at : part_at + MAX_WRITE_ENTRIES]
                    frees = state.apply_write(node.node, first + part_at, part)
                    seq = journal.append(
                        write_record(node.node, first + part_at, part),
                        frees,
                        written=mine,  # all in this commit: a superset for a part is fine
                    )
            journal.unreserve(promise)
        return seq, errors

    def _put_data(
        self,
        bs: int,
        sectors: builtins.list[int],
        pieces: builtins.list[tuple[bytes | memoryview, int]],
    ) -> None:
        """Write blocks to their new sectors: one vectored write per run of adjacent ones.

        `pieces` are (data, blocks) in the order of `sectors`: n blocks of bs bytes, or one
        block of at most bs (a compressed one; padded when a block follows it in the run).
        """
        pool = self._pool
        if len(sectors) == 1:  # one block: the common small write
            pool.pwrite(pieces[0][0], sectors[0] * SECTOR)
            return
        piece, done = 0, 0  # the next piece, and how many of its blocks are written
        for i, n in _runs(sectors, bs // SECTOR):
            buffers: builtins.list[bytes | memoryview] = []
            need = n
            while need:
                data, count = pieces[piece]
                take = min(count - done, need)
                if done == 0 and take == count:
                    buffers.append(data)
                else:
                    buffers.append(memoryview(data)[done * bs : (done + take) * bs])
                need -= take
                done += take
                if done == count:
                    piece, done = piece + 1, 0
                short = bs - len(data)
                if count == 1 and short and need:
                    buffers.append(_ZEROS[:short])
            at = sectors[i] * SECTOR
            if len(buffers) == 1:
                pool.pwrite(buffers[0], at)
                continue
            for k in range(0, len(buffers), _IOV_MAX):
                part = buffers[k : k + _IOV_MAX]
                pool.pwritev(part, at)
                at += sum(len(b) for b in part)

    def flush(self, volume_id: str) -> None:
        """See `VolumeStore.flush` (every write acknowledged so far, of every volume)."""
        vol = self._volume(volume_id)
        try:
            with self._lock:
                self._check_live(vol)
                seq = self._journal.appended
            with os_errors():
                self._journal.wait(seq)
        except BaseException:
            vol.stats.error()
            raise

    def trim(self, volume_id: str, offset: int, length: int) -> None:
        """See `VolumeStore.trim` (durable when it returns).

        A trim's cost grows with the blocks its range holds, in the volume and in its
        snapshots (where it leaves ZERO markers), not with the range's length. It is done
        in slices of at most `TRIM_SLICE_BLOCKS` blocks, each under one hold of the store's
        lock and with its own log record, so one large trim never stalls every other
        volume's I/O for long. Each slice starts at the next block the volume or a snapshot
        it reads through has an entry for (`next_to_trim`, which skips an empty stretch
        without looking at it block by block): a block without one reads as zeros already,
        so trimming it changes nothing. Each block reads as zeros or as before, whatever
        the crash point: a trim is not atomic (nor is a discard on a disk). A slice that
        changes nothing (already trimmed) logs nothing.
        """
        vol = self._volume(volume_id)
        try:
            node = vol.node
            first, count = check_range_in(node.size_bytes, node.block_size, offset, length)
            seq, logged = 0, False
            start: int | None = first
            while start is not None:
                seq, changed, start = self._trim_slice(vol, offset, length, start, first + count)
                logged = logged or changed
                if start is not None:
                    time.sleep(0)  # let the threads waiting for the lock have it
            with os_errors():
                self._journal.wait(seq)  # a trim that changed nothing: what made it so
                if logged:
                    self._journal.release_frees(seq)
        except BaseException:
            vol.stats.error()
            raise

    def _trim_slice(
        self, vol: _Volume, offset: int, length: int, start: int, end: int
    ) -> tuple[int, bool, int | None]:
        """Trim the next slice of blocks [start, end) that has something to trim.

        Returns the log record to wait for, whether it is ours, and where the rest of the
        range starts (None: nothing is left to trim).
        """
        node = vol.node
        with self._lock:
            self._check_live(vol)
            check_range_in(node.size_bytes, node.block_size, offset, length)  # not shrunk since
            at = next_to_trim(node, start, end)
            if at is None:  # nothing left in the range: it reads as zeros already
                return self._journal.appended, False, None
            stop = min(at + TRIM_SLICE_BLOCKS, end)
            rest = stop if stop < end else None
            with os_errors():
                promise = self._journal.reserve(64, emergency=True)
            frees, changed = self._state.trim(node.node, at, stop - at)
            if not changed:
                self._journal.unreserve(promise)
                return self._journal.appended, False, rest
            seq = self._journal.append(trim_record(node.node, at, stop - at), frees, promise)
            return seq, True, rest

    def stats(self, volume_id: str) -> VolumeStats:
        """See `VolumeStore.stats`."""
        vol = self._volume(volume_id)
        node = vol.node
        return dataclasses.replace(
            vol.stats.snapshot(),
            throttled_ops=vol.qos.throttled_ops,
            throttle_delay_us=vol.qos.delay_us,
            allocated_bytes=node.map.allocated * node.block_size,
        )

    def close(self) -> None:
        """See `VolumeStore.close`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            with os_errors():
                self._journal.close()
        finally:
            self._close_files()

    def _close_files(self) -> None:
        self._pool.close()
        for slot in self._slots:
            slot.close()

    # ------------------------------------------------------------ helpers

    def _free_bytes(self) -> int:
        """Space for new volume data now."""
        if self._capacity is not None:
            return max(0, self._capacity - self._space.used_bytes())
        return self._media.free_bytes() + self._space.free_backed_bytes()

    def _check_open(self) -> None:
        if self._closed:
            raise FailedPrecondition("the volume store is closed")

    def _check_live(self, vol: _Volume) -> None:
        self._check_open()
        if vol.deleted:
            raise NotFound(f"volume {vol.node.name!r} does not exist")

    def _volume(self, volume_id: str) -> _Volume:
        vol = self._volumes.get(volume_id)  # a dict lookup is atomic; ids there are valid
        if vol is None:
            check_volume_id(volume_id)
            self._check_open()
            raise NotFound(f"volume {volume_id!r} does not exist")
        if self._closed:
            raise FailedPrecondition("the volume store is closed")
        return vol

    def _snapshot(self, snapshot_id: str) -> Node:
        snap = self._state.snapshots.get(snapshot_id)
        if snap is None:
            raise NotFound(f"snapshot {snapshot_id!r} does not exist")
        return snap

    def _key(self, vol: _Volume) -> bytes | None:
        if vol.key is None and vol.node.sealed_key is not None:
            vol.key = self._sealer.unseal(_key_name(vol.node), vol.node.sealed_key)
        return vol.key

    def _codec(self, vol: _Volume) -> BlockCodec:
        node = vol.node
        codec = BlockCodec(node.name, node.services, node.block_size, self._key(vol))
        vol.codec = codec
        return codec

    # ------------------------------------------------------------ for tests and tools

    def commit(self) -> None:
        """Make everything so far durable (every volume)."""
        with self._lock:
            seq = self._journal.appended
        with os_errors():
            self._journal.wait(seq)

    def checkpoint(self) -> None:
        """Commit and write a checkpoint now."""
        with os_errors():
            self._journal.checkpoint_now()

    def physical(self, volume_id: str, offset: int) -> tuple[int, int] | None:
        """(pool byte offset, stored length) of the block at `offset`, or None if it reads zeros."""
        vol = self._volume(volume_id)
        node = vol.node
        with self._lock:
            entry = resolve(node, offset // node.block_size)
        if entry is None:
            return None
        return entry[0] * SECTOR, entry[1] & LENGTH_MASK


def _new_salt() -> int:
    return secrets.randbits(64) or 1
