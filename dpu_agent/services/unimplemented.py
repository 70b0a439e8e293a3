"""Handlers for API services this agent version does not serve yet.

Every method of such a service validates its request like any other RPC and then
answers UNIMPLEMENTED with a message naming the service, rather than a fake.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NoReturn

import grpc
from google.protobuf import descriptor, message_factory

from dpu_agent.errors import NotImplementedYet

if TYPE_CHECKING:
    from collections.abc import AsyncIterator


def _error(service: str, method: str, reason: str) -> NotImplementedYet:
    return NotImplementedYet(f"{service}.{method} is not served by this agent: {reason}")


def _unary(service: str, method: str, reason: str) -> Any:  # noqa: ANN401
    async def behavior(_request: object, _context: object) -> NoReturn:
        raise _error(service, method, reason)

    return behavior


def _stream(service: str, method: str, reason: str) -> Any:  # noqa: ANN401
    async def behavior(_request: object, _context: object) -> AsyncIterator[None]:
        if service:  # always: the `yield` below only makes this an async generator
            raise _error(service, method, reason)
        yield None

    return behavior


def unimplemented_handler(
    service: descriptor.ServiceDescriptor, reason: str
) -> grpc.GenericRpcHandler[Any, Any]:
    """A generic handler answering every method of `service` with UNIMPLEMENTED."""
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
    for method in service.methods:
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        if method.server_streaming:
            make, behavior = grpc.unary_stream_rpc_method_handler, _stream
        else:
            make, behavior = grpc.unary_unary_rpc_method_handler, _unary
        handlers[method.name] = make(
            behavior(service.full_name, method.name, reason),
            request_deserializer=request_cls.FromString,
            response_serializer=response_cls.SerializeToString,
        )
    return grpc.method_handlers_generic_handler(service.full_name, handlers)
