"""Conversions between dpu.v1 messages and the agent's domain objects."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Final

from google.protobuf import timestamp_pb2

from dpu_agent.dataplane import hostpolicy
from dpu_agent.dataplane.jobs import JobState
from dpu_agent.errors import InvalidArgument
from dpu_wire import endpoints, names
from dpu_wire.jobkinds import Result
from dpu_wire.transport.base import Access, PeerAddress, TcpAddress, VerbsAddress
from dpu_wire.transport.tcp import TOKEN_BYTES
from dpu_wire.v1 import common_pb2, job_pb2, session_pb2

if TYPE_CHECKING:
    from collections.abc import Iterable

    from dpu_agent.dataplane.jobs import JobRecord
    from dpu_agent.dataplane.regions import AdvertisedRegion
    from dpu_agent.dataplane.session import Session

GID_BYTES = 16
VERBS_MTUS = (256, 512, 1024, 2048, 4096)


def timestamp(ns: int) -> timestamp_pb2.Timestamp:
    """A protobuf Timestamp from nanoseconds since the epoch (unset when 0)."""
    ts = timestamp_pb2.Timestamp()
    if ns:
        ts.FromNanoseconds(ns)
    return ts


def parsed_name(name: str, what: str, *collections: str) -> tuple[str, ...]:
    """The ids in a resource name of these collections; InvalidArgument naming `what`."""
    try:
        return names.parse_name(name, *collections)
    except names.InvalidNameError as exc:
        raise InvalidArgument(f"{what}: {exc}") from None


def resource_id(name: str, collection: str, what: str) -> str:
    """The id in "{collection}/{id}"; InvalidArgument naming the field `what`."""
    (ident,) = parsed_name(name, what, collection)
    return ident


def region_id(s: Session, name: str, what: str) -> str:
    """The id in "sessions/{session}/regions/{id}", which must be a region of `s`."""
    prefix = f"{s.name}/regions/"
    if name.startswith(prefix):  # the common case, without parsing the whole name
        with contextlib.suppress(names.InvalidNameError):
            return names.check_id(name[len(prefix) :])
    owner, ident = parsed_name(name, what, "sessions", "regions")  # also says what is wrong
    if owner != s.session_id:
        raise InvalidArgument(f"{what}: {name} is not in {s.name}")
    return ident


def peer_address(endpoint: session_pb2.Endpoint) -> PeerAddress | None:
    """The host's data-plane address from OpenSession, checked."""
    address = endpoints.from_proto(endpoint)
    if isinstance(address, TcpAddress):
        if not address.host or not 0 < address.port < 65536:
            raise InvalidArgument("host_endpoint.tcp: host and a port 1..65535 are required")
        if len(address.token) != TOKEN_BYTES:
            raise InvalidArgument(
                f"host_endpoint.tcp.token must be {TOKEN_BYTES} random bytes (the host's HELLO)"
            )
    elif isinstance(address, VerbsAddress):
        if len(address.gid) != GID_BYTES:
            raise InvalidArgument(f"host_endpoint.verbs.gid must be {GID_BYTES} bytes")
        if hostpolicy.gid_address(address.gid) is None:
            raise InvalidArgument(
                "host_endpoint.verbs.gid must be an IPv4-mapped unicast address, "
                "::ffff:a.b.c.d, as the agent's RoCEv2 GID is"
            )
        if not 0 < address.qp_num < 1 << 24 or address.psn >= 1 << 24:
            raise InvalidArgument("host_endpoint.verbs: qp_num and psn are 24-bit numbers")
        if address.mtu not in VERBS_MTUS:
            raise InvalidArgument(f"host_endpoint.verbs.mtu must be one of {VERBS_MTUS}")
    return address


def session(s: Session, *, with_token: bool = False) -> session_pb2.Session:
    """The proto form of a session; the agent's tcp token only when `with_token`.

    The token is a secret of the session's data plane: OpenSession's answer carries it
    to the host, GetSession and ListSessions do not.
    """
    c = s.counters
    message = session_pb2.Session(
        name=s.name,
        tenant=s.tenant,
        transport=s.transport_kind,  # type: ignore[arg-type]
        state=int(s.state),  # type: ignore[arg-type]
        queue_depth=s.queue_depth,
        inline_max=s.link.inline_max,
        client_label=s.label,
        agent_endpoint=endpoints.to_proto(_shown(s.address, with_token=with_token)),
        times=common_pb2.ResourceTimes(
            create_time=timestamp(s.create_ns), update_time=timestamp(s.update_ns)
        ),
        counters=session_pb2.SessionCounters(
            jobs_submitted=c.jobs_submitted,
            jobs_completed=c.jobs_completed,
            jobs_failed=c.jobs_failed,
            bytes_read=c.bytes_read,
            bytes_written=c.bytes_written,
            regions=len(s.regions),
            jobs_native=c.jobs_native,
        ),
    )
    if s.error is not None:
        message.error.code, message.error.message = s.error
    return message


def _shown(address: PeerAddress | None, *, with_token: bool) -> PeerAddress | None:
    if isinstance(address, TcpAddress) and not with_token:
        return dataclasses.replace(address, token=b"")
    return address


ACCESS_FROM_PROTO = {
    session_pb2.REGION_ACCESS_REMOTE_READ: Access.REMOTE_READ,
    session_pb2.REGION_ACCESS_REMOTE_WRITE: Access.REMOTE_WRITE,
}


_READ, _WRITE = (
    int(session_pb2.REGION_ACCESS_REMOTE_READ),
    int(session_pb2.REGION_ACCESS_REMOTE_WRITE),
)
_COMMON_ACCESS: Final[
    dict[tuple[int, ...], Access]
] = {  # the lists hosts send, looked up at once (a region costs less)
    (_READ,): Access.REMOTE_READ,
    (_WRITE,): Access.REMOTE_WRITE,
    (_READ, _WRITE): Access.REMOTE_READ | Access.REMOTE_WRITE,
    (_WRITE, _READ): Access.REMOTE_READ | Access.REMOTE_WRITE,
}


def access(values: Iterable[int]) -> Access:
    """Access flags from the repeated RegionAccess field."""
    values = tuple(values)
    common = _COMMON_ACCESS.get(values)
    if common is not None:
        return common
    result = Access.NONE
    for value in values:
        if value not in ACCESS_FROM_PROTO:
            raise InvalidArgument("region access must be REMOTE_READ and/or REMOTE_WRITE")
        result |= ACCESS_FROM_PROTO[value]  # type: ignore[index]
    return result


def region(s: Session, r: AdvertisedRegion) -> session_pb2.MemoryRegion:
    """The proto form of an advertised region."""
    flags = [p for p, a in ACCESS_FROM_PROTO.items() if r.access & a]
    return session_pb2.MemoryRegion(
        name=f"{s.name}/regions/{r.region_id}",
        addr=r.addr,
        length=r.length,
        rkey=r.rkey,
        access=flags,
    )


def completion(s: Session, job: JobRecord) -> job_pb2.Completion:
    """The proto form of a finished job's completion."""
    name = f"{s.name}/jobs/{job.job_id}"
    if not job.done:
        return job_pb2.Completion(job=name, job_id=job.job_id)
    message = job_pb2.Completion(
        job=name,
        job_id=job.job_id,
        state=int(job.state),  # type: ignore[arg-type]
        status=common_pb2.Status(code=job.status, message=job.message),
        bytes_read=job.bytes_read,
        bytes_written=job.bytes_written,
        submit_time=timestamp(job.submit_ns),
        start_time=timestamp(job.start_ns),
        end_time=timestamp(job.end_ns),
        request_id=job.request_id,
    )
    if job.state == JobState.SUCCEEDED:
        if job.row.result is Result.CRC32C:
            message.crc32c = job.result
        if job.digest:
            message.sha256 = job.digest
    return message


def job(s: Session, record: JobRecord, spec: job_pb2.JobSpec | None = None) -> job_pb2.Job:
    """The proto form of a job."""
    message = job_pb2.Job(
        name=f"{s.name}/jobs/{record.job_id}",
        job_id=record.job_id,
        request_id=record.request_id,
        state=int(record.state),  # type: ignore[arg-type]
        submit_time=timestamp(record.submit_ns),
    )
    if spec is not None:
        message.spec.CopyFrom(spec)
    if record.done:
        message.completion.CopyFrom(completion(s, record))
    return message
