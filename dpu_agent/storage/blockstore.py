"""The block logic every backend shares, over two small primitives.

`BlockVolumeStore` implements `VolumeStore` (validation, data services, locking,
durability, statistics) on top of:

- a `BlockDevice` per volume: a byte-addressed container of `size_bytes` where block
  `i` has the fixed slot `[i * block_size, (i + 1) * block_size)`; a compressed block
  occupies the start of its slot, the rest of the slot is unused;
- a `Catalog`: the volumes (settings and sealed keys) and one `BlockRecord` per
  written block. Its methods are durable when they return.

Durability: a write puts its blocks on the device and its records in a per-volume
pending table (reads see them at once). `flush()` and `write(fua=True)` sync the
device first and then commit the pending records: a committed record always
describes data that is on stable storage. After a crash, a block written but never
flushed reads either as before the write or, when it overwrote a committed block in
place, fails its CRC (DataCorruption, or garbage without CRC) like a torn write on a
disk: only flushed data is promised. Trim and resize commit their metadata change
before they touch the device, so a crash in between leaves zeros, not stale data.

Locking: one lock per volume serializes its I/O and settings changes; the store's lock
guards only the table of volumes. Order: store lock, then a volume lock, then the
catalog's own lock.
"""

from __future__ import annotations

import abc
import builtins
import contextlib
import dataclasses
import errno
import logging
import threading
import time
from typing import TYPE_CHECKING, Final

from dpu_agent.auth import DEFAULT_TENANT
from dpu_agent.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from dpu_agent.storage.backend import VolumeStore
from dpu_agent.storage.dataservices import BlockCodec, BlockRecord
from dpu_agent.storage.errors import DataCorruption
from dpu_agent.storage.keys import check_key, generate_key
from dpu_agent.storage.stats import StatsCounter
from dpu_agent.storage.types import Encryption, VolumeInfo
from dpu_agent.storage.validate import (
    as_byte_view,
    check_block_size,
    check_fits,
    check_range,
    check_services,
    check_size,
    check_volume_id,
)

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping

    from dpu_agent.storage.keys import KeySealer
    from dpu_agent.storage.types import DataServices, VolumeStats

log = logging.getLogger(__name__)

DEFAULT_MAX_VOLUME_BYTES: Final = 1 << 40  # 1 TiB
# Pending records of one volume committed without waiting for a flush, to bound memory.
MAX_PENDING_RECORDS: Final = 65536


@dataclasses.dataclass(frozen=True)
class VolumeRow:
    """What a catalog keeps about a volume: its description and its sealed key."""

    info: VolumeInfo
    sealed_key: bytes | None = dataclasses.field(default=None, repr=False)


class BlockDevice(abc.ABC):
    """Where one volume's blocks live. Called under the volume's lock only."""

    @abc.abstractmethod
    def read(self, offset: int, length: int) -> bytes | bytearray:
        """`length` bytes at `offset`; never-written ranges read as zeros."""

    @abc.abstractmethod
    def write(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        """Store `data` at `offset` (not yet durable)."""

    @abc.abstractmethod
    def sync(self) -> None:
        """Make every write so far durable."""

    @abc.abstractmethod
    def discard(self, offset: int, length: int) -> None:
        """Drop a range: it reads as zeros and gives its space back where possible."""

    @abc.abstractmethod
    def resize(self, size_bytes: int) -> None:
        """Grow (with zeros) or shrink (dropping the tail), durably."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the device; a second call does nothing."""


class Catalog(abc.ABC):
    """Volumes and block records. Thread-safe; every change is durable on return."""

    @abc.abstractmethod
    def volumes(self) -> builtins.list[VolumeRow]:
        """Every volume."""

    @abc.abstractmethod
    def add_volume(self, row: VolumeRow) -> None:
        """Record a new volume."""

    @abc.abstractmethod
    def remove_volume(self, volume_id: str) -> None:
        """Forget a volume and its block records."""

    @abc.abstractmethod
    def set_size(
        self, volume_id: str, size_bytes: int, update_ns: int, drop_from_block: int | None
    ) -> None:
        """Change a volume's size, dropping the records of blocks >= `drop_from_block`."""

    @abc.abstractmethod
    def block_records(self, volume_id: str, first: int, count: int) -> dict[int, BlockRecord]:
        """The records of the written blocks among `first .. first + count - 1`."""

    @abc.abstractmethod
    def has_blocks_from(self, volume_id: str, first: int) -> bool:
        """True if some block >= `first` has a record."""

    @abc.abstractmethod
    def put_blocks(self, volume_id: str, records: Mapping[int, BlockRecord]) -> None:
        """Insert or replace block records."""

    @abc.abstractmethod
    def drop_blocks(self, volume_id: str, first: int, count: int) -> None:
        """Forget the records of blocks `first .. first + count - 1`."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the catalog; a second call does nothing."""


class _Volume:
    """The store's state of one volume. Holds the key (in its codec): never printed."""

    __slots__ = ("codec", "deleted", "device", "info", "lock", "pending", "sealed_key", "stats")

    def __init__(self, row: VolumeRow) -> None:
        self.info = row.info
        self.sealed_key = row.sealed_key
        self.lock = threading.Lock()
        self.device: BlockDevice | None = None
        self.codec: BlockCodec | None = None
        self.pending: dict[int, BlockRecord] = {}
        self.stats = StatsCounter()
        self.deleted = False

    def __repr__(self) -> str:
        return f"_Volume({self.info.volume_id!r})"


@contextlib.contextmanager
def os_errors() -> Iterator[None]:
    """Turn OSError from the backing storage into domain errors."""
    try:
        yield
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        if exc.errno in {errno.ENOSPC, errno.EDQUOT}:
            raise ResourceExhausted(f"no space left for volume data: {reason}") from exc
        if exc.errno == errno.EIO:
            raise DataCorruption(f"the volume's storage reported an I/O error: {reason}") from exc
        raise Unavailable(f"volume storage failed: {reason}") from exc


class BlockVolumeStore(VolumeStore):
    """A VolumeStore over per-volume `BlockDevice`s and a `Catalog`.

    Backends provide the devices (`_create_device`, `_open_device`, `_destroy_device`),
    the free space they draw on (`_free_bytes`) and the catalog. Space policy: volumes
    are thin (sparse); a volume, or a growth, is refused when it is larger than the
    space free at that moment. Nothing is reserved, so volumes together may promise
    more than there is; a write that finds no space fails with ResourceExhausted.
    """

    def __init__(
        self,
        catalog: Catalog,
        sealer: KeySealer,
        *,
        max_volume_bytes: int = DEFAULT_MAX_VOLUME_BYTES,
    ) -> None:
        if max_volume_bytes <= 0:
            raise InvalidArgument(f"max_volume_bytes {max_volume_bytes} is not positive")
        self._catalog = catalog
        self._sealer = sealer
        self._max_volume_bytes = max_volume_bytes
        self._lock = threading.Lock()
        self._closed = False
        self._volumes = {row.info.volume_id: _Volume(row) for row in catalog.volumes()}

    @property
    def max_volume_bytes(self) -> int:
        """The largest volume this store creates."""
        return self._max_volume_bytes

    # ------------------------------------------------------------ backend hooks

    @abc.abstractmethod
    def _create_device(self, info: VolumeInfo) -> BlockDevice:
        """A new, zero-filled device for a volume (replacing any leftover one)."""

    @abc.abstractmethod
    def _open_device(self, info: VolumeInfo) -> BlockDevice:
        """The existing device of a volume."""

    @abc.abstractmethod
    def _destroy_device(self, volume_id: str) -> None:
        """Remove a volume's device (closed already) and its data."""

    @abc.abstractmethod
    def _free_bytes(self) -> int:
        """Space free for new volume data now."""

    def _close_backend(self) -> None:
        """Release what the backend holds beyond the catalog and devices."""

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
    ) -> VolumeInfo:
        """See `VolumeStore.create`."""
        volume_id = check_volume_id(volume_id)
        block_size = check_block_size(block_size)
        services = check_services(services)
        size_bytes = check_size(size_bytes, block_size, self._max_volume_bytes)
        raw_key: bytes | None = None
        if services.encryption is Encryption.NONE:
            if key is not None:
                raise InvalidArgument("an encryption key was given for a volume without encryption")
        else:
            raw_key = check_key(key) if key is not None else generate_key()
        sealed = None if raw_key is None else self._sealer.seal(volume_id, raw_key)
        with self._lock:
            self._check_open()
            if volume_id in self._volumes:
                raise AlreadyExists(f"volume {volume_id!r} already exists")
            now = time.time_ns()
            info = VolumeInfo(volume_id, size_bytes, block_size, services, now, now, tenant)
            with os_errors():
                check_fits(size_bytes, self._free_bytes())
                device = self._create_device(info)
            try:
                self._catalog.add_volume(VolumeRow(info, sealed))
            except BaseException:
                device.close()
                self._destroy_device(volume_id)
                raise
            vol = _Volume(VolumeRow(info, sealed))
            vol.device = device
            vol.codec = BlockCodec(volume_id, services, block_size, raw_key)
            self._volumes[volume_id] = vol
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
        return info

    def get(self, volume_id: str) -> VolumeInfo:
        """See `VolumeStore.get`."""
        return self._volume(volume_id).info

    def list(self) -> builtins.list[VolumeInfo]:
        """See `VolumeStore.list`."""
        with self._lock:
            self._check_open()
            return [self._volumes[v].info for v in sorted(self._volumes)]

    def resize(self, volume_id: str, size_bytes: int, *, force: bool = False) -> VolumeInfo:
        """See `VolumeStore.resize`."""
        vol = self._volume(volume_id)
        with vol.lock:
            self._check_live(vol)
            info = vol.info
            size = check_size(size_bytes, info.block_size, self._max_volume_bytes)
            if size == info.size_bytes:
                return info
            now = time.time_ns()
            with os_errors():
                if size > info.size_bytes:
                    check_fits(size - info.size_bytes, self._free_bytes())
                    self._device(vol).resize(size)
                    self._catalog.set_size(info.volume_id, size, now, None)
                else:
                    self._shrink(vol, size, now, force=force)
            vol.info = resized = dataclasses.replace(info, size_bytes=size, update_ns=now)
        log.info("resized volume", extra={"volume_id": info.volume_id, "size_bytes": size})
        return resized

    def _shrink(self, vol: _Volume, size: int, now: int, *, force: bool) -> None:
        info = vol.info
        keep = size // info.block_size
        dropped = [b for b in vol.pending if b >= keep]
        if not force and (dropped or self._catalog.has_blocks_from(info.volume_id, keep)):
            raise FailedPrecondition(
                f"volume {info.volume_id!r} holds data past {size} bytes; "
                "shrinking would drop it (use force)"
            )
        for block in dropped:
            del vol.pending[block]
        self._catalog.set_size(info.volume_id, size, now, keep)
        self._device(vol).resize(size)

    def delete(self, volume_id: str) -> None:
        """See `VolumeStore.delete`."""
        volume_id = check_volume_id(volume_id)
        with self._lock:
            self._check_open()
            vol = self._volumes.get(volume_id)
            if vol is None:
                raise NotFound(f"volume {volume_id!r} does not exist")
            with vol.lock:
                self._forget(vol)
                vol.deleted = True
                del self._volumes[volume_id]
                vol.pending.clear()
                vol.codec = None
                if vol.device is not None:
                    vol.device.close()
                    vol.device = None
                try:
                    self._destroy_device(volume_id)
                except OSError as exc:  # the volume is gone; its file is an orphan now
                    log.warning(
                        "could not remove the data of a deleted volume",
                        extra={"volume_id": volume_id, "error": exc.strerror},
                    )
        log.info("deleted volume", extra={"volume_id": volume_id})

    def _forget(self, vol: _Volume) -> None:
        """Remove a volume from the catalog; on a full disk, drop its data first.

        The catalog needs free space even to delete rows (SQLite's WAL grows), so on a
        full store the delete that would make room could not run. The volume is going
        away: its data's space is given back first, then the catalog forgets it. Should
        that fail again, the volume stays listed without its data; a retry deletes it.
        """
        volume_id = vol.info.volume_id
        try:
            self._catalog.remove_volume(volume_id)
        except ResourceExhausted:
            log.warning(
                "no space to delete the volume; dropping its data first",
                extra={"volume_id": volume_id},
            )
            with os_errors():
                device = self._device(vol)
                device.resize(0)  # gives back every block it held, on any filesystem
                device.resize(vol.info.size_bytes)
            vol.pending.clear()
            self._catalog.remove_volume(volume_id)

    # ------------------------------------------------------------ I/O

    def read(self, volume_id: str, offset: int, length: int) -> bytes:
        """See `VolumeStore.read`."""
        start = time.perf_counter()
        with self._io(volume_id) as vol:
            first, count = check_range(vol.info, offset, length)
            codec = self._codec(vol)
            records = self._records(vol, first, count)
            raw = self._device(vol).read(offset, length)
            data = self._decode(codec, vol.info.block_size, first, raw, records)
            vol.stats.read(length, time.perf_counter() - start)
        return data

    @staticmethod
    def _decode(
        codec: BlockCodec,
        block_size: int,
        first: int,
        raw: bytes | bytearray,
        records: dict[int, BlockRecord],
    ) -> bytes:
        count = len(raw) // block_size
        view = memoryview(raw)
        if codec.stores_plain and len(records) == count:  # every block written, stored as is
            if not codec.transparent:
                for block, record in records.items():
                    at = (block - first) * block_size
                    codec.decode(block, view[at : at + block_size], record)  # checks the CRC
            return raw if isinstance(raw, bytes) else bytes(raw)
        zero = bytes(block_size)
        parts: builtins.list[bytes | memoryview] = []
        for block in range(first, first + count):
            found = records.get(block)
            if found is None:
                parts.append(zero)
            else:
                at = (block - first) * block_size
                parts.append(codec.decode(block, view[at : at + block_size], found))
        return b"".join(parts)

    def write(
        self, volume_id: str, offset: int, data: bytes | memoryview, *, fua: bool = False
    ) -> None:
        """See `VolumeStore.write`."""
        start = time.perf_counter()
        with self._io(volume_id) as vol:
            view = as_byte_view(data)
            length = view.nbytes
            first, count = check_range(vol.info, offset, length)
            codec = self._codec(vol)
            device = self._device(vol)
            bs = vol.info.block_size
            if codec.transparent:
                device.write(offset, view)
                vol.pending.update(dict.fromkeys(range(first, first + count), codec.raw_record))
            else:
                buf = bytearray(length)
                records: dict[int, BlockRecord] = {}
                for i in range(count):
                    at = i * bs
                    payload, records[first + i] = codec.encode(first + i, view[at : at + bs])
                    buf[at : at + len(payload)] = payload
                device.write(offset, buf)
                vol.pending.update(records)
            if fua or len(vol.pending) >= MAX_PENDING_RECORDS:
                self._commit(vol)
            vol.stats.write(length, time.perf_counter() - start)

    def flush(self, volume_id: str) -> None:
        """See `VolumeStore.flush`."""
        with self._io(volume_id) as vol:
            self._commit(vol)

    def trim(self, volume_id: str, offset: int, length: int) -> None:
        """See `VolumeStore.trim`."""
        with self._io(volume_id) as vol:
            first, count = check_range(vol.info, offset, length)
            for block in [b for b in vol.pending if first <= b < first + count]:
                del vol.pending[block]
            self._catalog.drop_blocks(vol.info.volume_id, first, count)
            self._device(vol).discard(offset, length)

    def stats(self, volume_id: str) -> VolumeStats:
        """See `VolumeStore.stats`."""
        return self._volume(volume_id).stats.snapshot()

    def close(self) -> None:
        """See `VolumeStore.close`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            volumes = builtins.list(self._volumes.values())
        failure: BaseException | None = None
        for vol in volumes:
            with vol.lock:
                try:
                    with os_errors():
                        self._commit(vol)
                except Exception as exc:  # flush the others, then report the first failure
                    log.exception("could not flush volume", extra={"volume_id": vol.info.volume_id})
                    failure = failure or exc
                finally:
                    if vol.device is not None:
                        vol.device.close()
                        vol.device = None
                    vol.codec = None
        self._catalog.close()
        self._close_backend()
        if failure is not None:
            raise failure

    # ------------------------------------------------------------ helpers

    def _check_open(self) -> None:
        if self._closed:
            raise FailedPrecondition("the volume store is closed")

    def _check_live(self, vol: _Volume) -> None:
        self._check_open()
        if vol.deleted:
            raise NotFound(f"volume {vol.info.volume_id!r} does not exist")

    def _volume(self, volume_id: str) -> _Volume:
        volume_id = check_volume_id(volume_id)
        with self._lock:
            self._check_open()
            vol = self._volumes.get(volume_id)
        if vol is None:
            raise NotFound(f"volume {volume_id!r} does not exist")
        return vol

    @contextlib.contextmanager
    def _io(self, volume_id: str) -> Iterator[_Volume]:
        """Hold a live volume's lock; count a failure as an error of the volume."""
        vol = self._volume(volume_id)
        with vol.lock:
            self._check_live(vol)
            try:
                with os_errors():
                    yield vol
            except DataCorruption as exc:
                vol.stats.error()
                log.warning(
                    "data corruption", extra={"volume_id": vol.info.volume_id, "error": str(exc)}
                )
                raise
            except BaseException:
                vol.stats.error()
                raise

    def _device(self, vol: _Volume) -> BlockDevice:
        if vol.device is None:
            vol.device = self._open_device(vol.info)
        return vol.device

    def _codec(self, vol: _Volume) -> BlockCodec:
        if vol.codec is None:
            info = vol.info
            key = None
            if vol.sealed_key is not None:
                key = self._sealer.unseal(info.volume_id, vol.sealed_key)
            vol.codec = BlockCodec(info.volume_id, info.services, info.block_size, key)
        return vol.codec

    def _records(self, vol: _Volume, first: int, count: int) -> dict[int, BlockRecord]:
        records = self._catalog.block_records(vol.info.volume_id, first, count)
        pending = vol.pending
        if pending:
            if count <= len(pending):
                for block in range(first, first + count):
                    record = pending.get(block)
                    if record is not None:
                        records[block] = record
            else:
                records.update((b, r) for b, r in pending.items() if first <= b < first + count)
        return records

    def _commit(self, vol: _Volume) -> None:
        """Sync the device, then commit the pending records: data before metadata."""
        if vol.device is not None:
            vol.device.sync()
        if vol.pending:
            self._catalog.put_blocks(vol.info.volume_id, vol.pending)
            vol.pending.clear()
