"""Server-interceptor plumbing shared by the services: re-wrapping a method handler, and turning
bytes that are not the method's message into INVALID_ARGUMENT instead of gRPC's INTERNAL."""

from __future__ import annotations

from typing import Callable

import grpc
from google.protobuf.message import DecodeError

Wrap = Callable[[Callable], Callable]


def rewrap(handler: grpc.RpcMethodHandler, unary: Wrap, stream: Wrap,
           deserializer: Callable | None = None) -> grpc.RpcMethodHandler:
    """The handler with its behavior wrapped by `unary` (one response) or `stream` (streamed
    responses), and its request deserializer replaced when `deserializer` is given."""
    deser = deserializer or handler.request_deserializer
    ser = handler.response_serializer
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), deser, ser)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(stream(handler.unary_stream), deser, ser)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary), deser, ser)
    return grpc.stream_stream_rpc_method_handler(stream(handler.stream_stream), deser, ser)


class Malformed:
    """Stands in for a request message whose bytes did not parse."""

    def __init__(self, error: str) -> None:
        self.error = error


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """A request that does not parse as the method's message gets INVALID_ARGUMENT naming the
    message type. gRPC's own answer would be INTERNAL, which reads as a server bug."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer
        type_name = getattr(getattr(parse, "__self__", None), "DESCRIPTOR", None)
        what = type_name.full_name if type_name is not None else "the method's request"

        def deserialize(data: bytes):
            try:
                return parse(data)
            except DecodeError as e:
                return Malformed(f"request is not a valid {what} message: {e}")

        async def check(request, context):
            if isinstance(request, Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
            if hasattr(request, "__aiter__"):
                return _checked(request, context)
            return request

        def unary(behavior):
            async def run(request, context):
                return await behavior(await check(request, context), context)
            return run

        def stream(behavior):
            async def run(request, context):
                async for response in behavior(await check(request, context), context):
                    yield response
            return run

        return rewrap(handler, unary, stream, deserialize)


async def _checked(requests, context):
    async for request in requests:
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
        yield request
