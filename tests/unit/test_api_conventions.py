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


def test_the_limits_the_proto_comments_state_are_the_agents():
    """The numbers the comments give an implementer are the ones the code enforces."""
    from pathlib import Path  # noqa: PLC0415

    from dpu_agent import paging  # noqa: PLC0415
    from dpu_agent.dataplane.manager import ManagerSettings  # noqa: PLC0415
    from dpu_agent.services.jobs import MAX_DEADLINE_S  # noqa: PLC0415
    from dpu_agent.storage.engine import DEFAULT_MAX_VOLUME_BYTES  # noqa: PLC0415

    protos = Path(__file__).resolve().parents[2] / "proto" / "dpu" / "v1"
    job, storage = (protos / "job.proto").read_text(), (protos / "storage.proto").read_text()
    assert f"At most {MAX_DEADLINE_S} s" in job
    assert ManagerSettings().default_deadline == 60
    assert "0 = the agent's default, 60 s" in job
    assert DEFAULT_MAX_VOLUME_BYTES == 1 << 40
    assert "at most 1 TiB (2^40 bytes" in storage
    sizes = f"0 = {paging.DEFAULT_PAGE_SIZE} "
    cap = f"more than {paging.MAX_PAGE_SIZE} is taken as {paging.MAX_PAGE_SIZE}"
    paged = [p.read_text() for p in protos.glob("*.proto")]  # six List calls, common.proto
    assert sum(text.count(sizes) for text in paged) == 7
    assert sum(text.count(cap) for text in paged) == 6
