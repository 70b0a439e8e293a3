"""Checks every dpu.v1 request gets before a service sees it.

Generic, descriptor-driven rules (so every RPC, served or not, gets the same):
- a request of a method in `MAX_REQUEST_BYTES` is at most that many bytes, checked
  before it is parsed (the interceptor; RESOURCE_EXHAUSTED);
- a repeated field holds at most `MAX_REPEATED` items, and a request at most
  `MAX_ITEMS` in all its repeated fields (RESOURCE_EXHAUSTED, as gRPC answers a message
  over its size limit); each count is checked before any item is looked at, so a
  request's cost to the event loop is bounded whatever it holds;
- enum fields hold a value the enum defines (proto3 enums are open on the wire);
- strings stay within `MAX_STRING_LENGTH`, request ids within `MAX_REQUEST_ID_LENGTH`;
- page sizes are not negative;
- resource names and ids named in `NAME_FIELDS` follow the grammar in `dpu_wire.names`.

The walk visits only the fields a rule applies to (strings, enums, messages, page
sizes: a plan per message type, made once), and checks a repeated field's items
together (one set difference for enums, one pass for string lengths).

Service-specific rules (contradictions, ranges) live beside each service.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Final

from google.protobuf import descriptor

from dpu_agent.errors import InvalidArgument, ResourceExhausted
from dpu_wire import API_PACKAGE, names

if TYPE_CHECKING:
    from collections.abc import Sequence

    from google.protobuf.message import Message

MAX_STRING_LENGTH: Final = 1024
MAX_REQUEST_ID_LENGTH: Final = 128
MAX_DEPTH: Final = 16
MAX_REPEATED: Final = 1024  # items of one repeated field (the most: 1024 regions)
MAX_ITEMS: Final = 4096  # items of all repeated fields of one request
# Serialized request sizes below the server's limit, checked before a request is
# parsed: a request too big to be valid costs the event loop nothing but a length.
# A region is at most ~300 bytes (a 256-character name, four numbers, two flags).
MAX_REGION_BYTES: Final = 320
MAX_REQUEST_BYTES: Final[dict[str, int]] = {
    "/dpu.v1.SessionService/AdvertiseRegions": MAX_REPEATED * MAX_REGION_BYTES,
}

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
    _check_fields(request, "", 0, _Budget())
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


_FD = descriptor.FieldDescriptor


@dataclasses.dataclass(frozen=True)
class _Rule:
    """One field a generic rule applies to."""

    name: str
    kind: int  # _FD.TYPE_STRING, TYPE_ENUM or TYPE_MESSAGE; TYPE_INT32 for page_size
    repeated: bool
    limit: int = 0  # strings: the longest allowed
    values: frozenset[int] = frozenset()  # enums: the defined numbers
    enum_name: str = ""


@functools.cache
def _plan(desc: descriptor.Descriptor) -> tuple[_Rule, ...]:
    """The fields of a message type that generic rules apply to."""
    rules = []
    for field in desc.fields:
        repeated = bool(field.is_repeated)
        if field.type == _FD.TYPE_STRING:
            limit = MAX_REQUEST_ID_LENGTH if field.name == "request_id" else MAX_STRING_LENGTH
            rules.append(_Rule(field.name, _FD.TYPE_STRING, repeated, limit=limit))
        elif field.type == _FD.TYPE_ENUM:
            enum = field.enum_type
            assert enum is not None  # noqa: S101 - an enum field has an enum type
            values = frozenset(enum.values_by_number)
            rules.append(
                _Rule(field.name, _FD.TYPE_ENUM, repeated, values=values, enum_name=enum.full_name)
            )
        elif field.type == _FD.TYPE_MESSAGE:
            rules.append(_Rule(field.name, _FD.TYPE_MESSAGE, repeated))
        elif field.name == "page_size" and not repeated:
            rules.append(_Rule(field.name, _FD.TYPE_INT32, repeated))
    return tuple(rules)


@dataclasses.dataclass
class _Budget:
    """Repeated items left for the rest of one request."""

    left: int = MAX_ITEMS

    def take(self, count: int, where: str) -> None:
        if count > MAX_REPEATED:
            raise ResourceExhausted(f"{where}: {count} items (at most {MAX_REPEATED})")
        self.left -= count
        if self.left < 0:
            raise ResourceExhausted(f"request: more than {MAX_ITEMS} items in repeated fields")


def _check_fields(message: Message, prefix: str, depth: int, budget: _Budget) -> None:
    """Check one message; `prefix` names its place ("regions.") for error messages."""
    if depth > MAX_DEPTH:
        raise InvalidArgument(f"{prefix or 'request'}: nested deeper than {MAX_DEPTH}")
    for rule in _plan(message.DESCRIPTOR):
        if rule.repeated:
            items = getattr(message, rule.name)
            if items:
                budget.take(len(items), prefix + rule.name)
                _check_items(rule, items, prefix, depth, budget)
        elif rule.kind == _FD.TYPE_MESSAGE:
            if message.HasField(rule.name):
                inner = f"{prefix}{rule.name}."
                _check_fields(getattr(message, rule.name), inner, depth + 1, budget)
        else:
            value = getattr(message, rule.name)
            if value and not (  # the common, valid case without a call
                value in rule.values
                if rule.kind == _FD.TYPE_ENUM
                else rule.kind == _FD.TYPE_STRING and len(value) <= rule.limit
            ):
                _check_items(rule, (value,), prefix, depth, budget)


def _check_items(
    rule: _Rule, items: Sequence[object], prefix: str, depth: int, budget: _Budget
) -> None:
    """Check a field's items together; the error names the field `prefix` + its name."""
    if rule.kind == _FD.TYPE_STRING:
        longest = max(map(len, items))  # type: ignore[arg-type]
        if longest > rule.limit:
            raise InvalidArgument(
                f"{prefix}{rule.name}: {longest} characters long (at most {rule.limit})"
            )
    elif rule.kind == _FD.TYPE_ENUM:
        unknown = [value for value in items if value not in rule.values]
        if unknown:
            raise InvalidArgument(
                f"{prefix}{rule.name}: unknown value {unknown[0]} for enum {rule.enum_name}"
            )
    elif rule.kind == _FD.TYPE_MESSAGE:
        inner = f"{prefix}{rule.name}."
        for item in items:
            _check_fields(item, inner, depth + 1, budget)  # type: ignore[arg-type]

    else:
        (value,) = items
        if isinstance(value, int) and value < 0:
            raise InvalidArgument(f"{prefix}{rule.name}: must not be negative, got {value}")
