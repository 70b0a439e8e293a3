from typing import Any

import pytest

from dpu_agent.errors import InvalidArgument, ResourceExhausted
from dpu_agent.validation import (
    MAX_ITEMS,
    MAX_REPEATED,
    MAX_REQUEST_BYTES,
    MAX_STRING_LENGTH,
    NAME_FIELDS,
    validate_request,
)
from dpu_wire.v1 import (
    agent_pb2,
    job_pb2,
    network_pb2,
    session_pb2,
    storage_pb2,
    virtualization_pb2,
)


def BAD(value: int) -> Any:  # noqa: N802 - reads like a marker in the tables
    """An enum value the type checker lets through, on purpose."""
    return value


MODULES = (agent_pb2, job_pb2, network_pb2, session_pb2, storage_pb2, virtualization_pb2)


def test_name_rules_name_real_fields():
    messages = {name: mod for mod in MODULES for name in mod.DESCRIPTOR.message_types_by_name}
    for message, fields in NAME_FIELDS.items():
        assert message in messages, message
        cls = getattr(messages[message], message)
        for path in fields:
            obj = cls()
            for part in path.split("."):
                obj = getattr(obj, part)  # raises if the field does not exist


def test_valid_requests_pass():
    validate_request(storage_pb2.GetVolumeRequest(name="volumes/v1"))
    validate_request(session_pb2.OpenSessionRequest(transport=agent_pb2.TRANSPORT_TCP))
    validate_request(job_pb2.ListJobsRequest(session="sessions/s1", page_size=10))
    validate_request(agent_pb2.GetAgentInfoRequest())


@pytest.mark.parametrize(
    ("request_msg", "message"),
    [
        (storage_pb2.GetVolumeRequest(name=""), "name: name is empty"),
        (storage_pb2.GetVolumeRequest(name="volumes/" + "x" * 70), "at most 63"),
        (storage_pb2.GetVolumeRequest(name="v" * 2000), "at most 1024"),
        (storage_pb2.CreateVolumeRequest(volume_id="Nope"), "volume_id"),
        (
            session_pb2.OpenSessionRequest(transport=BAD(99)),
            "unknown value 99 for enum dpu.v1.Transport",
        ),
        (job_pb2.ListJobsRequest(session="sessions/s", state=BAD(42)), "dpu.v1.JobState"),
        (job_pb2.ListJobsRequest(session="sessions/s", page_size=-1), "must not be negative"),
        (
            session_pb2.AdvertiseRegionsRequest(
                session="sessions/s", regions=[session_pb2.MemoryRegion(access=[BAD(1), BAD(7)])]
            ),
            r"regions\.access: unknown value 7",
        ),
        (
            network_pb2.UpdateFlowRuleRequest(flow_rule=network_pb2.FlowRule(name="rules/x")),
            r"flow_rule\.name",
        ),
        (
            virtualization_pb2.CreateFunctionRequest(
                function_id="f1", function=virtualization_pb2.Function(type=BAD(12))
            ),
            r"function\.type: unknown value 12",
        ),
        (storage_pb2.DeleteVolumeRequest(name="volumes/v", request_id="r" * 129), "at most 128"),
    ],
)
def test_invalid_requests_are_rejected_with_reason(request_msg, message):
    with pytest.raises(InvalidArgument, match=message):
        validate_request(request_msg)


def test_string_limit_applies_to_free_text():
    validate_request(session_pb2.OpenSessionRequest(client_label="x" * MAX_STRING_LENGTH))
    with pytest.raises(InvalidArgument, match="client_label"):
        validate_request(session_pb2.OpenSessionRequest(client_label="x" * (MAX_STRING_LENGTH + 1)))


READ = session_pb2.REGION_ACCESS_REMOTE_READ


def regions(count: int, access: int = 1) -> session_pb2.AdvertiseRegionsRequest:
    return session_pb2.AdvertiseRegionsRequest(
        session="sessions/s",
        regions=[
            session_pb2.MemoryRegion(name=f"sessions/s/regions/r{i}", access=[READ] * access)
            for i in range(count)
        ],
    )


def test_repeated_fields_are_bounded_before_their_items_are_looked_at():
    validate_request(regions(MAX_REPEATED))
    with pytest.raises(ResourceExhausted, match=r"regions: 1025 items \(at most 1024\)"):
        validate_request(regions(MAX_REPEATED + 1))
    big = regions(MAX_REPEATED + 1)
    big.regions[-1].access.append(BAD(99))  # never looked at: the count comes first
    with pytest.raises(ResourceExhausted):
        validate_request(big)


def test_a_request_holds_a_bounded_number_of_items_in_all():
    validate_request(regions(1024, access=2))  # 3072 items: a full, valid request
    with pytest.raises(ResourceExhausted, match=f"more than {MAX_ITEMS} items"):
        validate_request(regions(1024, access=4))  # 1024 x 4 access values nested
    with pytest.raises(ResourceExhausted, match=r"regions\.access: 2000 items"):
        validate_request(regions(1, access=2000))


def test_advertise_regions_has_a_byte_limit_a_full_valid_request_fits():
    longest_id = "r" * 63
    session = "sessions/s-" + "0" * 12
    request = session_pb2.AdvertiseRegionsRequest(
        session=session,
        request_id="x" * 128,
        regions=[
            session_pb2.MemoryRegion(
                name=f"{session}/regions/{longest_id[:-4]}{i:04d}",
                addr=(1 << 64) - 1,
                length=(1 << 64) - 1,
                rkey=(1 << 32) - 1,
                access=[READ, session_pb2.REGION_ACCESS_REMOTE_WRITE],
            )
            for i in range(MAX_REPEATED)
        ],
    )
    validate_request(request)
    limit = MAX_REQUEST_BYTES["/dpu.v1.SessionService/AdvertiseRegions"]
    assert request.ByteSize() <= limit
