"""`dpuctl volume ...`: volumes, snapshots, clones and QoS on the DPU, and file data in and out."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Final

from google.protobuf import json_format

from dpu_wire.v1 import storage_pb2
from host_client._display import enum_name, printable
from host_client._errors import InvalidArgumentError

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from host_client._client import Client
    from host_client._session import Buffer

CHUNK: Final = 1 << 20
IN_FLIGHT: Final = 8
UNITS: Final = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def size(text: str) -> int:
    """'4096', '64k', '10M', '1G' (binary units) as bytes."""
    value = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = value[-1:] if value[-1:] in UNITS else ""
    number = value[: len(value) - len(unit)]
    if not number.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 4096, 64k, 10M, 1G)")
    return int(number) * UNITS[unit]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The `volume` command and its actions."""
    volume = sub.add_parser("volume", help="volumes on the DPU")
    act = volume.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = act.add_parser("create", help="create a volume")
    create.add_argument("name", help="volumes/{id} or {id}")
    create.add_argument("--size", type=size, required=True, help="e.g. 1G")
    create.add_argument("--block-size", type=int, default=4096, choices=(512, 4096))
    create.add_argument("--crc32c", action="store_true", help="end-to-end CRC32C per block")
    create.add_argument("--compression", default="none", choices=("none", "lz4", "zstd"))
    create.add_argument("--encryption", default="none", choices=("none", "aes-xts-256"))
    create.add_argument(
        "--key-file", type=Path, help="64-byte AES-XTS key (default: the agent makes one)"
    )
    _add_qos_options(create)
    act.add_parser("list", help="every volume")
    get = act.add_parser("get", help="a volume's settings and stats, or its data with --output")
    get.add_argument("name")
    get.add_argument("--output", type=Path, help="read the volume's data into this file")
    get.add_argument("--length", type=size, help="bytes to read (default: the whole volume)")
    get.add_argument("--offset", type=size, default=0)
    put = act.add_parser("put", help="write a file into a volume (durable when it returns)")
    put.add_argument("name")
    put.add_argument("file", type=Path)
    put.add_argument("--offset", type=size, default=0)
    resize = act.add_parser("resize", help="grow (or, with --force, shrink) a volume")
    resize.add_argument("name")
    resize.add_argument("--size", type=size, required=True)
    resize.add_argument("--force", action="store_true")
    delete = act.add_parser("delete", help="delete a volume and its data (its snapshots stay)")
    delete.add_argument("name")
    qos = act.add_parser(
        "qos", help="change a volume's QoS limits (only those given; 0 removes a limit)"
    )
    qos.add_argument("name")
    _add_qos_options(qos)
    clone = act.add_parser(
        "clone", help="a new volume that starts as a snapshot (shares its blocks)"
    )
    clone.add_argument("snapshot", help="snapshots/{id} or {id}")
    clone.add_argument("name", help="the new volume: volumes/{id} or {id}")
    clone.add_argument("--size", type=size, default=0, help="default: the snapshot's size")
    _add_qos_options(clone)
    snapshot = act.add_parser("snapshot", help="read-only point-in-time snapshots of volumes")
    snap = snapshot.add_subparsers(dest="snapshot_action", required=True, metavar="ACTION")
    snap_create = snap.add_parser("create", help="snapshot a volume now")
    snap_create.add_argument("volume", help="volumes/{id} or {id}")
    snap_create.add_argument("snapshot", help="snapshots/{id} or {id}")
    snap_list = snap.add_parser("list", help="every snapshot, or a volume's")
    snap_list.add_argument("--volume", help="only the snapshots of this volume")
    snap_get = snap.add_parser("get", help="a snapshot's settings, size held and clones")
    snap_get.add_argument("snapshot")
    snap_delete = snap.add_parser("delete", help="delete a snapshot (not while it has clones)")
    snap_delete.add_argument("snapshot")


QOS_OPTIONS: Final = {  # option -> QosLimits field
    "--read-iops": "read_iops",
    "--write-iops": "write_iops",
    "--read-bps": "read_bytes_per_second",
    "--write-bps": "write_bytes_per_second",
}


def _add_qos_options(parser: argparse.ArgumentParser) -> None:
    for option, field in QOS_OPTIONS.items():
        unit = "bytes/s, e.g. 100M" if field.endswith("second") else "operations/s"
        parser.add_argument(option, dest=field, type=size, help=f"QoS limit ({unit})")


def _qos(args: argparse.Namespace) -> tuple[storage_pb2.QosLimits, list[str]]:
    """The QoS limits given on the command line, and which fields were given."""
    given = {f: getattr(args, f) for f in QOS_OPTIONS.values() if getattr(args, f) is not None}
    return storage_pb2.QosLimits(**given), sorted(given)


def _snapshot_name(text: str) -> str:
    return text if text.startswith("snapshots/") else f"snapshots/{text}"


def _name(text: str) -> str:
    return text if text.startswith("volumes/") else f"volumes/{text}"


def _services_text(services: storage_pb2.DataServices) -> str:
    parts = [
        "crc32c" if services.crc32c else "",
        enum_name(storage_pb2.Compression.Name, services.compression, "COMPRESSION_"),
        enum_name(storage_pb2.Encryption.Name, services.encryption, "ENCRYPTION_"),
    ]
    return ",".join(s.lower() for s in parts if s and s != "NONE") or "none"


def _line(v: storage_pb2.Volume) -> str:
    line = (
        f"{v.name:<32} {v.size_bytes:>14} B  block {v.block_size:<5} "
        f"services {_services_text(v.data_services)}"
    )
    limits = [f"{f}={getattr(v.qos, f)}" for f in QOS_OPTIONS.values() if getattr(v.qos, f)]
    if limits:
        line += f"  qos {','.join(limits)}"
    if v.source_snapshot:
        line += f"  clone of {v.source_snapshot}"
    return printable(line)


def _snapshot_line(s: storage_pb2.Snapshot) -> str:
    line = (
        f"{s.name:<32} of {s.source_volume:<28} {s.size_bytes:>14} B  "
        f"holds {s.allocated_bytes} B  services {_services_text(s.data_services)}"
    )
    if s.clones:
        line += f"  clones {','.join(s.clones)}"
    return printable(line)


class Progress:
    """A one-line progress bar on stderr when it is a terminal; a summary line always."""

    def __init__(self, what: str, total: int) -> None:
        self.what = what
        self.total = total
        self.done = 0
        self.start = time.perf_counter()
        self.live = sys.stderr.isatty()

    def advance(self, amount: int) -> None:
        """Count `amount` more bytes."""
        self.done += amount
        if self.live:
            share = self.done / self.total if self.total else 1.0
            bar = "#" * int(share * 30)
            sys.stderr.write(f"\r{self.what} [{bar:<30}] {share:6.1%} {self._rate()}")
            sys.stderr.flush()

    def _rate(self) -> str:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        return f"{self.done / elapsed / (1 << 20):8.1f} MiB/s"

    def finish(self) -> None:
        """The summary line."""
        if self.live:
            sys.stderr.write("\n")
        print(
            f"{self.what}: {self.done} bytes in {time.perf_counter() - self.start:.2f} s"
            f" ({self._rate().strip()})",
            file=sys.stderr,
        )


async def _put(client: Client, args: argparse.Namespace) -> int:
    name = _name(args.name)
    volume = await client.get_volume(name)
    data = args.file.read_bytes()
    block = volume.block_size
    padded = -(-len(data) // block) * block  # whole blocks, the tail padded with zeros
    if args.offset % block or args.offset + padded > volume.size_bytes:
        raise InvalidArgumentError(
            "INVALID_ARGUMENT",
            f"{args.file} ({len(data)} bytes) at offset {args.offset} does not fit {name} "
            f"({volume.size_bytes} bytes, block {block})",
        )
    progress = Progress(f"put {args.file} -> {name}", len(data))
    async with await client.open_session(queue_depth=IN_FLIGHT) as session:
        buffers = [await session.alloc(CHUNK, readable=True) for _ in range(IN_FLIGHT)]

        async def send(offset: int, buffer: Buffer) -> None:
            chunk = data[offset : offset + CHUNK]
            length = -(-len(chunk) // block) * block
            buffer.view[: len(chunk)] = chunk
            buffer.view[len(chunk) : length] = bytes(length - len(chunk))
            await session.write_volume(name, args.offset + offset, buffer[0:length])
            progress.advance(len(chunk))

        await _pipeline(buffers, range(0, len(data), CHUNK), send)
        (await (await session.submit_volume_flush(name))).raise_for_status()
    progress.finish()
    return 0


async def _get_data(client: Client, args: argparse.Namespace) -> int:
    name = _name(args.name)
    volume = await client.get_volume(name)
    length = volume.size_bytes - args.offset if args.length is None else args.length
    block = volume.block_size
    if args.offset % block or args.offset + length > volume.size_bytes:
        raise InvalidArgumentError(
            "INVALID_ARGUMENT",
            f"{length} bytes at offset {args.offset} are not within {name} "
            f"({volume.size_bytes} bytes, block {block})",
        )
    progress = Progress(f"get {name} -> {args.output}", length)
    with args.output.open("wb") as out:
        out.truncate(length)
        async with await client.open_session(queue_depth=IN_FLIGHT) as session:
            buffers = [await session.alloc(CHUNK, writable=True) for _ in range(IN_FLIGHT)]

            async def fetch(offset: int, buffer: Buffer) -> None:
                wanted = min(CHUNK, length - offset)
                whole = -(-wanted // block) * block  # the volume reads whole blocks
                await session.read_volume(name, args.offset + offset, buffer[0:whole])
                out.seek(offset)
                out.write(buffer.view[:wanted])
                progress.advance(wanted)

            await _pipeline(buffers, range(0, length, CHUNK), fetch)
    progress.finish()
    return 0


async def _pipeline(
    buffers: list[Buffer], offsets: range, work: Callable[[int, Buffer], Awaitable[None]]
) -> None:
    """Run `work(offset, buffer)` over the offsets, one buffer per job in flight."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for offset in offsets:
        queue.put_nowait(offset)

    async def worker(buffer: Buffer) -> None:
        while not queue.empty():
            await work(queue.get_nowait(), buffer)

    await asyncio.gather(*(worker(b) for b in buffers))


def _show(volume: storage_pb2.Volume, args: argparse.Namespace) -> int:
    if args.json:
        print(json_format.MessageToJson(volume, preserving_proto_field_name=True))
    else:
        print(_line(volume))
    return 0


async def _create(client: Client, args: argparse.Namespace) -> int:
    key = args.key_file.read_bytes() if args.key_file else None
    volume = await client.create_volume(
        _name(args.name).removeprefix("volumes/"),
        args.size,
        block_size=args.block_size,
        crc32c=args.crc32c,
        compression=args.compression,
        encryption=args.encryption,
        key=key,
        qos=_qos(args)[0],
    )
    return _show(volume, args)


async def _set_qos(client: Client, args: argparse.Namespace) -> int:
    limits, fields = _qos(args)
    if not fields:
        raise InvalidArgumentError(
            "INVALID_ARGUMENT", f"give at least one of {', '.join(QOS_OPTIONS)}"
        )
    return _show(await client.set_volume_qos(_name(args.name), limits, fields=fields), args)


async def _clone(client: Client, args: argparse.Namespace) -> int:
    volume = await client.clone_volume(
        _name(args.name).removeprefix("volumes/"),
        _snapshot_name(args.snapshot),
        size_bytes=args.size,
        qos=_qos(args)[0],
    )
    return _show(volume, args)


async def _snapshot(client: Client, args: argparse.Namespace) -> int:
    action = args.snapshot_action
    if action == "list":
        snaps = await client.list_snapshots(_name(args.volume) if args.volume else "")
        if args.json:
            print(json.dumps([json_format.MessageToDict(s) for s in snaps], indent=2))
        else:
            for snap in snaps:
                print(_snapshot_line(snap))
            if not snaps:
                print("no snapshots")
        return 0
    if action == "delete":
        await client.delete_snapshot(_snapshot_name(args.snapshot))
        print(printable(f"deleted {_snapshot_name(args.snapshot)}"))
        return 0
    if action == "create":
        snap = await client.create_snapshot(
            _snapshot_name(args.snapshot).removeprefix("snapshots/"), _name(args.volume)
        )
    else:
        snap = await client.get_snapshot(_snapshot_name(args.snapshot))
    if args.json:
        print(json_format.MessageToJson(snap, preserving_proto_field_name=True))
    else:
        print(_snapshot_line(snap))
    return 0


async def _list(client: Client, args: argparse.Namespace) -> int:
    volumes = await client.list_volumes()
    if args.json:
        print(json.dumps([json_format.MessageToDict(v) for v in volumes], indent=2))
        return 0
    for volume in volumes:
        print(_line(volume))
    if not volumes:
        print("no volumes")
    return 0


async def _get(client: Client, args: argparse.Namespace) -> int:
    if args.output is not None:
        return await _get_data(client, args)
    return _show(await client.get_volume(_name(args.name)), args)


async def _resize(client: Client, args: argparse.Namespace) -> int:
    return _show(await client.resize_volume(_name(args.name), args.size, force=args.force), args)


async def _delete(client: Client, args: argparse.Namespace) -> int:
    await client.delete_volume(_name(args.name))
    print(printable(f"deleted {_name(args.name)}"))
    return 0


ACTIONS: Final[dict[str, Callable[[Client, argparse.Namespace], Awaitable[int]]]] = {
    "create": _create,
    "list": _list,
    "get": _get,
    "put": _put,
    "resize": _resize,
    "delete": _delete,
    "qos": _set_qos,
    "clone": _clone,
    "snapshot": _snapshot,
}


async def run(client: Client, args: argparse.Namespace) -> int:
    """Dispatch a `volume` action."""
    return await ACTIONS[args.action](client, args)
