"""VirtualizationService: functions for the host and its guests (a thin layer over the manager)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Final

from dpu_agent import auth, paging
from dpu_agent.errors import InvalidArgument, NotFound, PermissionDenied
from dpu_agent.offload import in_thread
from dpu_agent.services.convert import resource_id, timestamp
from dpu_agent.virtualization.model import (
    DEFAULT_MTU,
    MUTABLE_FIELDS,
    FunctionRecord,
    FunctionSpec,
    FunctionState,
    FunctionType,
    normalize_mac,
)
from dpu_wire import names
from dpu_wire.v1 import common_pb2, virtualization_pb2, virtualization_pb2_grpc

if TYPE_CHECKING:
    import grpc

    from dpu_agent.storage.backend import VolumeStore
    from dpu_agent.virtualization.manager import FunctionManager

_TYPES_IN: Final = {
    virtualization_pb2.FUNCTION_TYPE_VF: FunctionType.VF,
    virtualization_pb2.FUNCTION_TYPE_SF: FunctionType.SF,
    virtualization_pb2.FUNCTION_TYPE_VIRTIO_NET: FunctionType.VIRTIO_NET,
    virtualization_pb2.FUNCTION_TYPE_VIRTIO_BLK: FunctionType.VIRTIO_BLK,
    virtualization_pb2.FUNCTION_TYPE_NVME: FunctionType.NVME,
}
_TYPES_OUT: Final = {v: k for k, v in _TYPES_IN.items()}
_STATES: Final = {
    FunctionState.CREATING: virtualization_pb2.FUNCTION_STATE_CREATING,
    FunctionState.READY: virtualization_pb2.FUNCTION_STATE_READY,
    FunctionState.DELETING: virtualization_pb2.FUNCTION_STATE_DELETING,
    FunctionState.FAILED: virtualization_pb2.FUNCTION_STATE_FAILED,
}
# proto field -> spec field, for the update mask
_MASK_FIELDS: Final = {
    "mac_address": "mac",
    "mtu": "mtu",
    "vlan_id": "vlan_id",
    "rate_limit_bps": "rate_limit_bps",
    "trust": "trust",
    "spoof_check": "spoof_check",
}
assert set(_MASK_FIELDS.values()) == MUTABLE_FIELDS  # noqa: S101 - a table kept in step
ISOLATION: Final = frozenset({"vlan_id", "rate_limit_bps", "trust", "spoof_check"})
"""Spec fields that separate one tenant's traffic from another's: an admin's to set."""


def _check_isolation(fields: set[str]) -> None:
    """PermissionDenied when a caller without the admin role sets one of `ISOLATION`."""
    chosen = sorted(fields & ISOLATION)
    if chosen and not auth.current_principal().admin:
        raise PermissionDenied(
            f"function.{chosen[0]}: a function's isolation (vlan_id, rate_limit_bps, trust, "
            "spoof_check) is set by an admin"
        )


def _volume_id(text: str) -> str:
    return resource_id(text, "volumes", "function.volume") if text else ""


def spec_from(function_id: str, f: virtualization_pb2.Function, tenant: str) -> FunctionSpec:
    """The domain spec of a CreateFunction request (InvalidArgument for bad fields)."""
    kind = _TYPES_IN.get(f.type)
    if kind is None:
        raise InvalidArgument("function.type: required (vf, sf, virtio-net, virtio-blk or nvme)")
    return FunctionSpec(
        function_id=function_id,
        type=kind,
        tenant=tenant,
        mac=normalize_mac(f.mac_address, "function.mac_address"),
        mtu=f.mtu or DEFAULT_MTU,
        vlan_id=f.vlan_id if f.HasField("vlan_id") else None,
        rate_limit_bps=f.rate_limit_bps,
        trust=f.trust,
        spoof_check=f.spoof_check,
        volume_id=_volume_id(f.volume),
    )


def function_to(r: FunctionRecord) -> virtualization_pb2.Function:
    """The proto function."""
    s, made = r.spec, r.provisioned
    out = virtualization_pb2.Function(
        name=f"functions/{s.function_id}",
        type=_TYPES_OUT[s.type],
        mac_address=made.facts.get("mac", s.mac) if made else s.mac,
        mtu=s.mtu,
        rate_limit_bps=s.rate_limit_bps,
        trust=s.trust,
        spoof_check=s.spoof_check,
        volume=f"volumes/{s.volume_id}" if s.volume_id else "",
        representor_port=f"ports/{made.representor_port}" if made and made.representor_port else "",
        host_device=made.host_device if made else "",
        state=_STATES[r.state],
        tenant=s.tenant,
        times=common_pb2.ResourceTimes(
            create_time=timestamp(r.created_ns), update_time=timestamp(r.updated_ns)
        ),
    )
    if s.vlan_id is not None:
        out.vlan_id = s.vlan_id
    return out


def changes_from(
    f: virtualization_pb2.Function, paths: list[str], *, block: bool
) -> dict[str, object]:
    """The spec fields an UpdateFunction request changes."""
    if not paths:
        raise InvalidArgument(
            f"update_mask: name the fields to change ({', '.join(sorted(_MASK_FIELDS))})"
        )
    changes: dict[str, object] = {}
    for path in paths:
        field = _MASK_FIELDS.get(path)
        if field is None:
            raise InvalidArgument(
                f"update_mask: cannot update {path!r} (only {', '.join(sorted(_MASK_FIELDS))})"
            )
        if field == "mac":
            changes[field] = normalize_mac(f.mac_address, "function.mac_address")
        elif field == "vlan_id":
            changes[field] = f.vlan_id if f.HasField("vlan_id") else None
        elif field == "mtu":
            changes[field] = f.mtu or DEFAULT_MTU
        else:
            changes[field] = getattr(f, path)
    if block and set(changes) & {"mac", "vlan_id", "rate_limit_bps"}:
        raise InvalidArgument("a block function has no network settings (mac, vlan, rate limit)")
    return changes


class VirtualizationService(virtualization_pb2_grpc.VirtualizationServiceServicer):
    """Create, inspect, change and delete functions; the manager works in a thread.

    Tenancy (`dpu_agent.auth`): a function belongs to the tenant that creates it, and
    a block function may only expose a volume its tenant can see. Another tenant's
    function answers NOT_FOUND exactly as a missing one does; admins see all.
    """

    def __init__(self, manager: FunctionManager, volumes: VolumeStore | None = None) -> None:
        self._manager = manager
        self._volumes = volumes

    def _visible(self, function_id: str) -> FunctionRecord:
        """The function, if the caller may see it; NotFound (the same text) otherwise."""
        record = self._manager.get(function_id)
        auth.check_owner(record.spec.tenant, f"functions/{function_id}")
        return record

    async def CreateFunction(
        self,
        request: virtualization_pb2.CreateFunctionRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> virtualization_pb2.Function:
        """Make a function (a retry with the same spec returns the one made)."""
        spec = spec_from(request.function_id, request.function, auth.tenant())
        if not auth.current_principal().admin:
            f = request.function
            chosen = {"vlan_id"} if f.HasField("vlan_id") else set()
            chosen |= {name for name in ("rate_limit_bps", "trust") if getattr(f, name)}
            _check_isolation(chosen)
            spec = dataclasses.replace(spec, spoof_check=True)  # sends only from its own MAC
        if spec.type.is_block and self._volumes is not None:
            info = await in_thread(self._volumes.get, spec.volume_id)
            auth.check_owner(info.tenant, f"volume {spec.volume_id!r}")  # the store's text
        existing = await in_thread(self._existing, spec)
        if existing is not None:
            return function_to(existing)
        return function_to(await in_thread(self._manager.create, spec))

    def _existing(self, spec: FunctionSpec) -> FunctionRecord | None:
        try:
            record = self._manager.get(spec.function_id)
        except NotFound:
            return None
        return record if record.spec == spec else None

    async def GetFunction(
        self,
        request: virtualization_pb2.GetFunctionRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> virtualization_pb2.Function:
        """One function."""
        (function_id,) = names.parse_name(request.name, "functions")
        return function_to(await in_thread(self._visible, function_id))

    async def ListFunctions(
        self,
        request: virtualization_pb2.ListFunctionsRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> virtualization_pb2.ListFunctionsResponse:
        """Functions by id, a page at a time."""
        records = [r for r in await in_thread(self._manager.list) if auth.can_see(r.spec.tenant)]
        page, token = paging.page(records, lambda r: r.spec.function_id, request)
        return virtualization_pb2.ListFunctionsResponse(
            functions=[function_to(r) for r in page], next_page_token=token
        )

    async def UpdateFunction(
        self,
        request: virtualization_pb2.UpdateFunctionRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> virtualization_pb2.Function:
        """Change the fields named in the mask (mac, mtu, vlan, rate limit, trust, spoof check)."""
        (function_id,) = names.parse_name(request.function.name, "functions")
        record = await in_thread(self._visible, function_id)
        changes = changes_from(
            request.function, list(request.update_mask.paths), block=record.spec.type.is_block
        )
        _check_isolation(set(changes))
        return function_to(await in_thread(self._manager.update, function_id, changes))

    async def DeleteFunction(
        self,
        request: virtualization_pb2.DeleteFunctionRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> virtualization_pb2.DeleteFunctionResponse:
        """Remove a function (FAILED_PRECONDITION while a flow rule or a mount uses it)."""
        (function_id,) = names.parse_name(request.name, "functions")
        await in_thread(self._visible, function_id)
        await in_thread(self._manager.delete, function_id)
        return virtualization_pb2.DeleteFunctionResponse()
