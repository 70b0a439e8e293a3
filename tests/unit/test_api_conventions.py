"""The dpu.v1 API follows its own conventions (proto/dpu/v1/common.proto)."""

import pytest
from google.protobuf import descriptor

from dpu_wire.v1 import (
    agent_pb2,
    job_pb2,
    network_pb2,
    session_pb2,
    storage_pb2,
    virtualization_pb2,
)

FILES = [
    m.DESCRIPTOR
    for m in (agent_pb2, job_pb2, network_pb2, session_pb2, storage_pb2, virtualization_pb2)
]
METHODS = [method for f in FILES for s in f.services_by_name.values() for method in s.methods]
READ_ONLY_PREFIXES = ("Get", "List", "Watch")


def test_every_file_is_in_the_versioned_package():
    assert {f.package for f in FILES} == {"dpu.v1"}


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.full_name)
def test_mutating_calls_carry_an_idempotency_key(method):
    fields = method.input_type.fields_by_name
    if method.name.startswith(READ_ONLY_PREFIXES):
        assert "request_id" not in fields
    else:
        assert "request_id" in fields, f"{method.full_name} mutates but has no request_id"
        assert fields["request_id"].type == descriptor.FieldDescriptor.TYPE_STRING


@pytest.mark.parametrize(
    "method", [m for m in METHODS if m.name.startswith("List")], ids=lambda m: m.full_name
)
def test_list_calls_are_paged(method):
    request = method.input_type.fields_by_name
    assert request["page_size"].type == descriptor.FieldDescriptor.TYPE_INT32
    assert request["page_token"].type == descriptor.FieldDescriptor.TYPE_STRING
    assert "next_page_token" in method.output_type.fields_by_name


def test_counters_and_sizes_are_64_bit():
    checked = 0
    for f in FILES:
        for message in f.message_types_by_name.values():
            if not message.name.endswith(("Counters", "Stats")):
                continue
            for field in message.fields:
                if field.type == descriptor.FieldDescriptor.TYPE_MESSAGE:
                    continue
                checked += 1
                assert field.type == descriptor.FieldDescriptor.TYPE_UINT64, field.full_name
    assert checked >= 20


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.full_name)
def test_resources_are_named(method):
    if method.full_name == "dpu.v1.AgentService.GetAgentInfo":
        return  # a singleton: the agent being called
    if method.name.startswith(("Get", "Delete", "Close", "Cancel", "Withdraw")):
        assert "name" in method.input_type.fields_by_name, method.full_name
