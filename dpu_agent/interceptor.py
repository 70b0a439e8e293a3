"""The one place where RPCs meet domain code.

For every RPC the interceptor:
- sets the request id (from `x-request-id` metadata, or a new one) for logs and
  echoes it in the trailing metadata;
- works out the caller's principal (`dpu_agent.identity`: client certificate, bearer
  token or loopback) and sets it for `dpu_agent.auth`; a dpu.v1 call without valid
  credentials is refused UNAUTHENTICATED before its service runs (health checks pass
  without credentials);
- refuses a request larger than its method allows before parsing it, and runs the
  generic request validation (`dpu_agent.validation`);
- answers a mutating call's retry (the same request_id) with the first call's reply
  (`dpu_agent.replies`);
- maps domain errors (`dpu_agent.errors`) to gRPC status codes, and any other
  exception to INTERNAL without leaking its text;
- writes one access-log line with method, tenant, status code and duration.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, NoReturn, cast

import grpc
from google.protobuf.message import DecodeError, Message

from dpu_agent import auth, errors, request_context
from dpu_agent.replies import Replies, request_digest, request_id_of
from dpu_agent.status import FOR_OTHER_ERRORS, status_for
from dpu_agent.stream_slots import StreamSlots
from dpu_agent.validation import MAX_REQUEST_BYTES, validate_request
from dpu_wire import API_PACKAGE, REQUEST_ID_METADATA_KEY

if TYPE_CHECKING:
    from dpu_agent.identity import Authenticator

log = logging.getLogger(__name__)

_MAX_REQUEST_ID = 128


def _request_id(context: grpc.aio.ServicerContext[Any, Any]) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_METADATA_KEY and isinstance(value, str) and value:
            return value[:_MAX_REQUEST_ID]
    return uuid.uuid4().hex


class _Rpc:
    """Book-keeping of one call: context variables, outcome and the access log."""

    def __init__(self, method: str, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        self.method = method
        self.context = context
        self.rid = _request_id(context)
        self.code = grpc.StatusCode.OK
        self.start = time.perf_counter()
        # Each RPC runs in its own task (its own context copy): no reset needed.
        request_context.request_id.set(self.rid)
        request_context.rpc_method.set(method)
        auth.principal.set(None)
        self.tenant = ""
        context.set_trailing_metadata(((REQUEST_ID_METADATA_KEY, self.rid),))

    def authenticate(self, authenticator: Authenticator) -> None:
        """Set the caller's principal; Unauthenticated for a dpu.v1 call without one."""
        try:
            principal = authenticator.authenticate(self.context)
        except errors.Unauthenticated:
            if self.method.startswith(f"/{API_PACKAGE}."):
                raise
            return  # health checks: answered without credentials
        auth.principal.set(principal)
        self.tenant = principal.tenant

    @contextlib.asynccontextmanager
    async def guard(self) -> AsyncIterator[None]:
        """Around the call: any error becomes its status; the access log line at the end."""
        try:
            yield
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - every error becomes a status
            await self.fail(exc)
        finally:
            self.finish()

    async def fail(self, exc: Exception) -> NoReturn:
        """Abort the call with the status the exception maps to."""
        if isinstance(exc, errors.AgentError):
            self.code = status_for(exc)
            await self.context.abort(self.code, str(exc))
        self.code = FOR_OTHER_ERRORS
        log.error("unhandled error in %s", self.method, exc_info=exc)
        await self.context.abort(self.code, f"internal error (request id {self.rid})")

    def finish(self) -> None:
        """Write the access-log line."""
        code = self.context.code() if self.code == grpc.StatusCode.OK else self.code
        log.info(
            "rpc",
            extra={
                "method": self.method,
                "tenant": self.tenant,
                "code": code.name if isinstance(code, grpc.StatusCode) else str(code or "OK"),
                "ms": round((time.perf_counter() - self.start) * 1000, 3),
            },
        )


@dataclasses.dataclass(frozen=True)
class _Undecodable:
    """Stands in for a request whose bytes did not parse, so the RPC can reject it."""

    type_name: str
    error: str


@dataclasses.dataclass(frozen=True)
class _Oversized:
    """Stands in for a request larger than its method allows (not parsed at all)."""

    method: str
    size: int
    limit: int


def _lenient(deserializer: Callable[[bytes], Any] | None, method: str) -> Callable[[bytes], Any]:
    """Wrap a request deserializer: corrupt bytes become `_Undecodable`, too many `_Oversized`."""
    limit = MAX_REQUEST_BYTES.get(method)

    def deserialize(data: bytes) -> Any:  # noqa: ANN401 - a request message
        if deserializer is None:
            return data
        if limit is not None and len(data) > limit:
            return _Oversized(method, len(data), limit)
        try:
            return deserializer(data)
        except DecodeError as exc:
            return _Undecodable(method, str(exc))

    return deserialize


def _check(request: object) -> None:
    if isinstance(request, _Oversized):
        raise errors.ResourceExhausted(
            f"request of {request.method} is {request.size} bytes (at most {request.limit})"
        )
    if isinstance(request, _Undecodable):
        raise errors.InvalidArgument(f"request of {request.type_name} is not a valid message")
    if isinstance(request, Message):
        validate_request(request)


UnaryBehavior = Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[Any]]
StreamBehavior = Callable[[Any, grpc.aio.ServicerContext[Any, Any]], AsyncIterator[Any]]
WriterBehavior = Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[None]]
BidiBehavior = Callable[
    [AsyncIterator[Any], grpc.aio.ServicerContext[Any, Any]], AsyncIterator[Any]
]


def _wrap_unary(
    method: str, inner: UnaryBehavior, authenticator: Authenticator, replies: Replies
) -> UnaryBehavior:
    async def behavior(request: object, context: grpc.aio.ServicerContext[Any, Any]) -> Any:  # noqa: ANN401
        rpc = _Rpc(method, context)
        async with rpc.guard():
            rpc.authenticate(authenticator)
            _check(request)
            key = request_id_of(method, request)
            if key:
                return await replies.call(
                    rpc.tenant,
                    method,
                    key,
                    lambda: inner(request, context),
                    request_digest(request),
                )
            return await inner(request, context)

    return behavior


def _wrap_stream(
    method: str, inner: StreamBehavior, authenticator: Authenticator
) -> StreamBehavior:
    async def behavior(
        request: object, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        rpc = _Rpc(method, context)
        async with rpc.guard():
            rpc.authenticate(authenticator)
            _check(request)
            async for item in inner(request, context):
                yield item

    return behavior


def _wrap_writer(
    method: str, inner: WriterBehavior, authenticator: Authenticator, slots: StreamSlots
) -> WriterBehavior:
    """Wrap a server-streaming handler that writes with `context.write` and returns.

    grpc's health servicer's Watch is one: it is awaited, not iterated (iterating it
    failed every Watch with INTERNAL and a logged traceback).
    """

    async def behavior(request: object, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        rpc = _Rpc(method, context)
        async with rpc.guard():
            rpc.authenticate(authenticator)
            _check(request)
            with slots.hold(context.peer()):
                await inner(request, context)

    return behavior


def _wrap_bidi(method: str, inner: BidiBehavior, slots: StreamSlots) -> BidiBehavior:
    """Server reflection's stream: no credentials, held in a slot of `slots`."""

    async def behavior(
        requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        rpc = _Rpc(method, context)
        async with rpc.guard():
            with slots.hold(context.peer()):
                async for item in inner(requests, context):
                    yield item

    return behavior


if TYPE_CHECKING:
    _Interceptor = grpc.aio.ServerInterceptor[Any, Any]
    _Handler = grpc.RpcMethodHandler[Any, Any]
else:  # grpc's classes are not subscriptable at run time
    _Interceptor = grpc.aio.ServerInterceptor
    _Handler = grpc.RpcMethodHandler


class RpcInterceptor(_Interceptor):
    """Request ids, principals, validation, error mapping and access logs.

    Unary and server-streaming calls are wrapped, and so is server reflection's
    bidirectional stream; the streams held without credentials take a slot of `slots`
    (`dpu_agent.stream_slots`).
    """

    def __init__(self, authenticator: Authenticator) -> None:
        self._authenticator = authenticator
        self._replies = Replies()
        self.slots = StreamSlots()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[_Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> _Handler:
        """Wrap the handler's behaviour; other handler kinds pass through."""
        handler: _Handler | None = await continuation(handler_call_details)
        if handler is None:  # unknown method: grpc answers UNIMPLEMENTED itself
            return None  # type: ignore[return-value]  # grpc-stubs misses the Optional
        method: str = handler_call_details.method
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(
                    method,
                    cast("UnaryBehavior", handler.unary_unary),
                    self._authenticator,
                    self._replies,
                ),
                request_deserializer=_lenient(handler.request_deserializer, method),
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            stream = handler.unary_stream
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(method, cast("StreamBehavior", stream), self._authenticator)
                if inspect.isasyncgenfunction(stream)
                else _wrap_writer(
                    method, cast("WriterBehavior", stream), self._authenticator, self.slots
                ),
                request_deserializer=_lenient(handler.request_deserializer, method),
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream is not None and not method.startswith(f"/{API_PACKAGE}."):
            return grpc.stream_stream_rpc_method_handler(
                _wrap_bidi(method, cast("BidiBehavior", handler.stream_stream), self.slots),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler
