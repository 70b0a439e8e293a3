from typing import Any

import pytest

from dpu_agent.errors import InvalidArgument
from dpu_agent.validation import MAX_STRING_LENGTH, NAME_FIELDS, validate_request
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
