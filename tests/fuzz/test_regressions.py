"""Requests the fuzzer found answered INTERNAL, replayed as they were found.

Each one now gets a domain status; the fuzz run would find them again, these make
the failure obvious without waiting for the right draw.
"""

from __future__ import annotations

import grpc
import pytest

from dpu_wire.v1 import job_pb2, network_pb2, session_pb2
from tests.fuzz import rpcs

BY_NAME = {str(rpc): rpc for rpc in rpcs.all_rpcs()}


def _unencodable_host() -> bytes:
    endpoint = session_pb2.TcpEndpoint(host="a" * 64, port=1, token=bytes(32))  # IDNA refuses it
    request = session_pb2.OpenSessionRequest(host_endpoint=session_pb2.Endpoint(tcp=endpoint))
    return request.SerializeToString()


def _huge_deadline(world) -> bytes:
    fuzz = world.sessions[0]
    spec = job_pb2.JobSpec()
    spec.crc32c.source.region = fuzz.buffers[0].name
    spec.crc32c.source.length = 4096
    spec.deadline.seconds = 2**62  # timedelta overflowed
    return job_pb2.SubmitJobRequest(session=fuzz.name, spec=spec).SerializeToString()


def _bad_watched_name() -> bytes:
    return network_pb2.WatchFlowCountersRequest(names=["not a name"]).SerializeToString()


@pytest.mark.parametrize(
    ("rpc", "request_bytes", "code"),
    [
        ("SessionService/OpenSession", _unencodable_host, grpc.StatusCode.PERMISSION_DENIED),
        ("JobService/SubmitJob", _huge_deadline, grpc.StatusCode.INVALID_ARGUMENT),
        ("NetworkService/WatchFlowCounters", _bad_watched_name, grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
def test_found_by_fuzzing(fuzz_loop, channel, world, rpc, request_bytes, code):
    fuzz_loop.run(world.restore())
    data = request_bytes(world) if request_bytes is _huge_deadline else request_bytes()
    outcome = fuzz_loop.run(rpcs.call(channel, BY_NAME[rpc], data))
    assert outcome.code == code, outcome
