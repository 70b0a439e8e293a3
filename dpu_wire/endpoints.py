"""Data-plane addresses ↔ the dpu.v1 Endpoint message, for both sides."""

from __future__ import annotations

from dpu_wire.transport.base import PeerAddress, TcpAddress, VerbsAddress
from dpu_wire.v1 import session_pb2


def to_proto(address: PeerAddress | None) -> session_pb2.Endpoint:
    """The Endpoint message for an address (empty for None)."""
    if isinstance(address, TcpAddress):
        tcp = session_pb2.TcpEndpoint(host=address.host, port=address.port, token=address.token)
        return session_pb2.Endpoint(tcp=tcp)
    if isinstance(address, VerbsAddress):
        verbs = session_pb2.VerbsEndpoint(
            gid=address.gid,
            qp_num=address.qp_num,
            psn=address.psn,
            mtu=address.mtu,
            lid=address.lid,
        )
        return session_pb2.Endpoint(verbs=verbs)
    return session_pb2.Endpoint()


def from_proto(endpoint: session_pb2.Endpoint) -> PeerAddress | None:
    """The address in an Endpoint message, unchecked (None when empty)."""
    kind = endpoint.WhichOneof("kind")
    if kind == "verbs":
        v = endpoint.verbs
        return VerbsAddress(bytes(v.gid), v.qp_num, v.psn, v.mtu, v.lid)
    if kind == "tcp":
        return TcpAddress(endpoint.tcp.host, endpoint.tcp.port, bytes(endpoint.tcp.token))
    return None
