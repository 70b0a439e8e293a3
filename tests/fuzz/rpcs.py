"""Every RPC of every dpu.v1 service, found from the descriptors, and one guarded call.

`all_rpcs()` imports each `*_pb2` module of `dpu_wire.v1`, so a service added to
proto/ (and generated) is fuzzed without touching this suite.

`call()` sends serialized request bytes (so damaged wire data can be sent too) and
reports how the call ended. A unary call gets `HANG_S` seconds; a stream must show
it is alive within `HANG_S` (initial metadata, a message or its end), then it is
read for a short while and cancelled. Running out of that time is a hang.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import pkgutil
from typing import TYPE_CHECKING, Any, Final

import grpc
from google.protobuf import message_factory

import dpu_wire.v1
from dpu_wire import REQUEST_ID_METADATA_KEY

if TYPE_CHECKING:
    from google.protobuf import descriptor as pbd

HANG_S: Final = 10.0
STREAM_READ_S: Final = 0.05
STREAM_MAX_MESSAGES: Final = 8
CLIENT_DEADLINE_DETAILS: Final = "Deadline Exceeded"
BAD_CODES: Final = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})
_EOF: Final[object] = grpc.aio.EOF  # type: ignore[attr-defined]  # missing from grpc-stubs


@dataclasses.dataclass(frozen=True)
class Rpc:
    """One method of one service."""

    service: str
    method: str
    request: pbd.Descriptor
    response: pbd.Descriptor
    streaming: bool

    @property
    def path(self) -> str:
        """/package.Service/Method."""
        return f"/{self.service}/{self.method}"

    def __str__(self) -> str:
        return f"{self.service.rsplit('.', 1)[-1]}/{self.method}"


def all_rpcs() -> list[Rpc]:
    """Every RPC of every service generated into dpu_wire.v1."""
    found: dict[str, Rpc] = {}
    for info in pkgutil.iter_modules(dpu_wire.v1.__path__):
        if not info.name.endswith("_pb2"):
            continue
        module = importlib.import_module(f"dpu_wire.v1.{info.name}")
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                if method.client_streaming:
                    raise AssertionError(f"{method.full_name}: client streaming is not fuzzed yet")
                rpc = Rpc(
                    service.full_name,
                    method.name,
                    method.input_type,
                    method.output_type,
                    method.server_streaming,
                )
                found[rpc.path] = rpc
    return [found[path] for path in sorted(found)]


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How one call ended."""

    code: grpc.StatusCode
    details: str
    messages: int = 0
    hung: bool = False
    stream_open: bool = False

    @property
    def failure(self) -> str | None:
        """Why this outcome breaks the fuzz contract, or None."""
        if self.hung:
            return "hang: no answer within the bound"
        if self.code in BAD_CODES:
            return f"{self.code.name}: {self.details}"
        return None


def _metadata(request_id: str | None) -> tuple[tuple[str, str], ...] | None:
    return None if request_id is None else ((REQUEST_ID_METADATA_KEY, request_id),)


async def call(
    channel: grpc.aio.Channel, rpc: Rpc, data: bytes, request_id: str | None = None
) -> Outcome:
    """Send `data` as the request of `rpc` and report the outcome."""
    decode = message_factory.GetMessageClass(rpc.response).FromString
    if rpc.streaming:
        return await _stream(channel, rpc, data, decode, request_id)
    method: Any = channel.unary_unary(
        rpc.path, request_serializer=None, response_deserializer=decode
    )
    try:
        await method(data, timeout=HANG_S, metadata=_metadata(request_id))
    except grpc.aio.AioRpcError as exc:
        details = exc.details() or ""
        hung = (
            exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and details == CLIENT_DEADLINE_DETAILS
        )
        return Outcome(exc.code(), details, hung=hung)
    return Outcome(grpc.StatusCode.OK, "", messages=1)


async def call_all(
    channel: grpc.aio.Channel, rpc: Rpc, batch: list[tuple[bytes, str | None]]
) -> list[Outcome]:
    """Send a batch of requests to `rpc` concurrently."""
    return await asyncio.gather(*(call(channel, rpc, data, rid) for data, rid in batch))


async def _stream(
    channel: grpc.aio.Channel,
    rpc: Rpc,
    data: bytes,
    decode: Any,
    request_id: str | None,
) -> Outcome:
    method: Any = channel.unary_stream(
        rpc.path, request_serializer=None, response_deserializer=decode
    )
    stream = method(data, timeout=HANG_S * 3, metadata=_metadata(request_id))
    try:
        try:
            await asyncio.wait_for(stream.initial_metadata(), HANG_S)
        except TimeoutError:
            return Outcome(grpc.StatusCode.DEADLINE_EXCEEDED, "stream silent", hung=True)
        loop = asyncio.get_running_loop()
        until = loop.time() + STREAM_READ_S
        messages = 0
        while messages < STREAM_MAX_MESSAGES:
            try:
                item = await asyncio.wait_for(stream.read(), max(0.0, until - loop.time()))
            except TimeoutError:
                break
            except grpc.aio.AioRpcError as exc:
                return Outcome(exc.code(), exc.details() or "", messages)
            if item is _EOF:
                return Outcome(await stream.code(), await stream.details() or "", messages)
            messages += 1
        return Outcome(grpc.StatusCode.OK, "open", messages, stream_open=True)
    finally:
        stream.cancel()
