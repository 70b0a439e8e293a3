"""Checks every dpu.v1 request gets before a service sees it.

Generic, descriptor-driven rules (so every RPC, served or not, gets the same):
- enum fields hold a value the enum defines (proto3 enums are open on the wire);
- strings stay within `MAX_STRING_LENGTH`, request ids within `MAX_REQUEST_ID_LENGTH`;
- page sizes are not negative;
- resource names and ids named in `NAME_FIELDS` follow the grammar in `dpu_wire.names`.

Service-specific rules (contradictions, ranges) live beside each service.
"""

from __future__ import annotations

from typing import Final

from google.protobuf import descriptor
from google.protobuf.message import Message

from dpu_agent.errors import InvalidArgument
from dpu_wire import API_PACKAGE, names

MAX_STRING_LENGTH: Final = 1024
MAX_REQUEST_ID_LENGTH: Final = 128
MAX_DEPTH: Final = 16

# request message -> {field path: collections of the name, or () for a bare id}
NAME_FIELDS: Final[dict[str, dict[str, tuple[str, ...]]]] = {
    "GetSessionRequest": {"name": ("sessions",)},
    "CloseSessionRequest": {"name": ("sessions",)},
    "AdvertiseRegionsRequest": {"session": ("sessions",)},
    "WithdrawRegionRequest": {"name": ("sessions", "regions")},
    "AttachVolumeRequest": {"session": ("sessions",), "volume": ("volumes",)},
    "DetachVolumeRequest": {"session": ("sessions",), "volume": ("volumes",)},
    "RegisterKeyRequest": {"session": ("sessions",)},
    "SubmitJobRequest": {"session": ("sessions",)},
    "GetJobRequest": {"name": ("sessions", "jobs")},
    "ListJobsRequest": {"session": ("sessions",)},
    "CancelJobRequest": {"name": ("sessions", "jobs")},
    "WatchCompletionsRequest": {"session": ("sessions",)},
    "CreateVolumeRequest": {"volume_id": ()},
    "GetVolumeRequest": {"name": ("volumes",)},
    "ResizeVolumeRequest": {"name": ("volumes",)},
    "DeleteVolumeRequest": {"name": ("volumes",)},
    "UpdateVolumeRequest": {"volume.name": ("volumes",)},
    "CreateSnapshotRequest": {"snapshot_id": (), "snapshot.source_volume": ("volumes",)},
    "GetSnapshotRequest": {"name": ("snapshots",)},
    "DeleteSnapshotRequest": {"name": ("snapshots",)},
    "GetPortRequest": {"name": ("ports",)},
    "CreateFlowRuleRequest": {"flow_rule_id": ()},
    "GetFlowRuleRequest": {"name": ("flowRules",)},
    "UpdateFlowRuleRequest": {"flow_rule.name": ("flowRules",)},
    "DeleteFlowRuleRequest": {"name": ("flowRules",)},
    "CreateFunctionRequest": {"function_id": ()},
    "GetFunctionRequest": {"name": ("functions",)},
    "UpdateFunctionRequest": {"function.name": ("functions",)},
    "DeleteFunctionRequest": {"name": ("functions",)},
}


def validate_request(request: Message) -> None:
    """Raise InvalidArgument if `request` breaks a generic rule of the API."""
    desc = request.DESCRIPTOR
    if desc.file.package != API_PACKAGE:
        return
    _check_fields(request, "", 0)
    for path, collections in NAME_FIELDS.get(desc.name, {}).items():
        value = _get_path(request, path)
        try:
            if collections:
                names.parse_name(value, *collections)
            else:
                names.check_id(value, path)
        except names.InvalidNameError as exc:
            raise InvalidArgument(f"{path}: {exc}") from None


def _get_path(message: Message, path: str) -> str:
    obj: object = message
    for part in path.split("."):
        obj = getattr(obj, part)
    return str(obj)


def _check_fields(message: Message, prefix: str, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise InvalidArgument(f"{prefix or 'request'}: nested deeper than {MAX_DEPTH}")
    for field, value in message.ListFields():
        where = f"{prefix}{field.name}"
        values = list(value) if _is_repeated(field) else [value]
        for item in values:
            _check_value(field, item, where, depth)


def _is_repeated(field: descriptor.FieldDescriptor) -> bool:
    return bool(field.is_repeated)


def _check_value(field: descriptor.FieldDescriptor, value: object, where: str, depth: int) -> None:
    if field.type == descriptor.FieldDescriptor.TYPE_ENUM:
        enum = field.enum_type
        assert enum is not None  # noqa: S101 - an enum field has an enum type
        if value not in enum.values_by_number:
            raise InvalidArgument(f"{where}: unknown value {value} for enum {enum.full_name}")
    elif field.type == descriptor.FieldDescriptor.TYPE_STRING:
        assert isinstance(value, str)  # noqa: S101 - protobuf guarantees it
        limit = MAX_REQUEST_ID_LENGTH if field.name == "request_id" else MAX_STRING_LENGTH
        if len(value) > limit:
            raise InvalidArgument(f"{where}: {len(value)} characters long (at most {limit})")
    elif field.type == descriptor.FieldDescriptor.TYPE_MESSAGE:
        assert isinstance(value, Message)  # noqa: S101
        _check_fields(value, f"{where}.", depth + 1)
    elif field.name == "page_size" and isinstance(value, int) and value < 0:
        raise InvalidArgument(f"{where}: must not be negative, got {value}")
