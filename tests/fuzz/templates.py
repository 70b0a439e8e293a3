"""Valid requests built from the world's live objects, for the fuzzer to mutate.

A generic message with every field random rarely gets through a service's own
checks (a volume needs a size that is a multiple of its block size, a job needs
spans inside its session's regions, a flow rule a consistent match and actions).
These strategies draw requests that are valid, or nearly: the fuzzer then
overwrites up to two fields with generic values (`Hints.templates`).

Names are looked up when drawn, so templates follow `World.restore`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from google.protobuf import field_mask_pb2
from hypothesis import strategies as st

from dpu_wire.v1 import (
    common_pb2,
    job_pb2,
    network_pb2,
    session_pb2,
    storage_pb2,
    virtualization_pb2,
)
from tests.fuzz.world import NEW_IDS, REQUEST_IDS

if TYPE_CHECKING:
    from google.protobuf.message import Message

    from tests.fuzz.world import World

_MATCHES: Final = (
    network_pb2.FlowMatch(),
    network_pb2.FlowMatch(ethertype=0x0800, ip_protocol=6, dst_l4_port=443),
    network_pb2.FlowMatch(ethertype=0x86DD, src_ip_prefix="2001:db8::/64"),
    network_pb2.FlowMatch(dst_mac="02:00:00:00:00:02", vlan_id=100),
    network_pb2.FlowMatch(ethertype=0x0800, ip_protocol=17, vxlan_vni=42, dst_l4_port=4789),
)


def _action(**kind: Any) -> network_pb2.FlowAction:
    return network_pb2.FlowAction(**kind)


_COUNT: Final = _action(count=network_pb2.CountAction())
_ACTIONS: Final = (
    (_COUNT, _action(forward=network_pb2.ForwardAction(port="ports/pf0vf1"))),
    (_action(drop=network_pb2.DropAction()),),
    (_action(mirror=network_pb2.MirrorAction(port="ports/pf0vf2")), _COUNT),
    (_action(police=network_pb2.PoliceAction(rate_bps=10**9, burst_bytes=65536)),),
    (
        _action(vlan_push=network_pb2.VlanPushAction(vlan_id=10, priority=3)),
        _action(forward=network_pb2.ForwardAction(port="ports/pf0vf1")),
    ),
    (
        _action(
            vxlan_encap=network_pb2.VxlanEncapAction(vni=7, src_ip="10.0.0.1", dst_ip="10.0.0.2")
        ),
        _action(forward=network_pb2.ForwardAction(port="ports/p0")),
    ),
)


_ACCESS: Final[list[list[Any]]] = [[1], [2], [1, 2]]


def _live(pool: list[str]) -> st.SearchStrategy[str]:
    return st.integers(0, 1 << 16).map(lambda i: pool[i % len(pool)] if pool else "")


def templates(world: World) -> dict[str, st.SearchStrategy[Message]]:
    """Template strategies by message full name."""
    ids = st.one_of(st.sampled_from(NEW_IDS), st.from_regex(r"fz-[a-z0-9]{1,8}", fullmatch=True))
    request_ids = st.one_of(st.just(""), st.sampled_from(REQUEST_IDS), st.uuids().map(str))
    ports = _live(world.pools["ports"])
    volumes = _live(world.pools["volumes"])
    sizes = st.sampled_from([4096, 65536, 1 << 20, 4 << 20])
    services = st.builds(
        storage_pb2.DataServices,
        crc32c=st.booleans(),
        compression=st.sampled_from([0, 1, 2, 3]),
        encryption=st.sampled_from([0, 1]),
    )
    xts = st.builds(
        storage_pb2.DataServices,
        crc32c=st.booleans(),
        encryption=st.just(storage_pb2.ENCRYPTION_AES_XTS_256),
    )
    volume = st.builds(
        storage_pb2.Volume,
        size_bytes=sizes,
        block_size=st.sampled_from([0, 512, 4096]),
        data_services=services,
    )
    encrypted = st.builds(
        storage_pb2.Volume, size_bytes=sizes, block_size=st.just(4096), data_services=xts
    )
    create_volume = st.one_of(
        st.builds(
            storage_pb2.CreateVolumeRequest, volume_id=ids, volume=volume, request_id=request_ids
        ),
        st.builds(
            storage_pb2.CreateVolumeRequest,
            volume_id=ids,
            volume=encrypted,
            encryption_key=st.sampled_from([b"", bytes(range(64))]),
        ),
    )
    flow_rule = st.builds(
        network_pb2.FlowRule,
        name=_live(world.pools["rules"]),
        priority=st.integers(1, 300),
        ingress_port=ports,
        match=st.sampled_from(_MATCHES),
        actions=st.sampled_from(_ACTIONS).map(list),
        offload=st.sampled_from([0, 1, 2, 3]),
    )
    mask = st.lists(st.sampled_from(["priority", "match", "actions", "offload"]), unique=True)
    function = st.one_of(
        st.builds(
            virtualization_pb2.Function,
            name=_live(world.pools["functions"]),
            type=st.sampled_from([1, 2, 3]),
            mac_address=st.sampled_from(["", "02:00:00:00:01:01", "02:00:00:00:01:02"]),
            mtu=st.sampled_from([0, 1500, 9000]),
            rate_limit_bps=st.sampled_from([0, 10**9]),
            trust=st.booleans(),
            spoof_check=st.booleans(),
        ),
        st.builds(
            virtualization_pb2.Function,
            name=_live(world.pools["functions"]),
            type=st.sampled_from([4, 5]),
            volume=volumes,
        ),
    )
    function_mask = st.lists(
        st.sampled_from(["mac_address", "mtu", "vlan_id", "rate_limit_bps", "trust"]),
        min_size=1,
        unique=True,
    )
    endpoint = session_pb2.Endpoint(
        tcp=session_pb2.TcpEndpoint(host="127.0.0.1", port=world.sink.port)
    )
    return {
        "dpu.v1.CreateVolumeRequest": create_volume,
        "dpu.v1.ResizeVolumeRequest": st.builds(
            storage_pb2.ResizeVolumeRequest,
            name=volumes,
            size_bytes=st.sampled_from([512, 4096, 1 << 20, 2 << 20, 8 << 20]),
            force=st.booleans(),
        ),
        "dpu.v1.FlowRule": flow_rule,
        "dpu.v1.CreateFlowRuleRequest": st.builds(
            network_pb2.CreateFlowRuleRequest,
            flow_rule_id=ids,
            flow_rule=flow_rule,
            request_id=request_ids,
        ),
        "dpu.v1.UpdateFlowRuleRequest": st.builds(
            network_pb2.UpdateFlowRuleRequest,
            flow_rule=flow_rule,
            update_mask=mask.map(_field_mask),
        ),
        "dpu.v1.Function": function,
        "dpu.v1.CreateFunctionRequest": st.builds(
            virtualization_pb2.CreateFunctionRequest, function_id=ids, function=function
        ),
        "dpu.v1.UpdateFunctionRequest": st.builds(
            virtualization_pb2.UpdateFunctionRequest,
            function=function,
            update_mask=function_mask.map(_field_mask),
        ),
        "dpu.v1.OpenSessionRequest": st.builds(
            session_pb2.OpenSessionRequest,
            transport=st.sampled_from([0, 2]),
            queue_depth=st.sampled_from([0, 1, 8, 1024]),
            host_endpoint=st.just(endpoint),
            request_id=request_ids,
        ),
        "dpu.v1.RegisterKeyRequest": st.builds(
            session_pb2.RegisterKeyRequest,
            session=_live(world.pools["sessions"]),
            key=st.sampled_from([16, 24, 32]).flatmap(lambda n: st.binary(min_size=n, max_size=n)),
        ),
        "dpu.v1.AdvertiseRegionsRequest": _advertise(world),
        "dpu.v1.SubmitJobRequest": _submit_job(world),
    }


def _field_mask(paths: list[str]) -> field_mask_pb2.FieldMask:
    return field_mask_pb2.FieldMask(paths=paths)


def _advertise(world: World) -> st.SearchStrategy[Message]:
    @st.composite
    def draw(draw_: st.DrawFn) -> Message:
        names = world.pools["sessions"]
        session = names[draw_(st.integers(0, 1 << 8)) % len(names)] if names else ""
        count = draw_(st.integers(1, 3))
        regions = [
            session_pb2.MemoryRegion(
                name=f"{session}/regions/fz-{draw_(st.integers(0, 20))}",
                addr=draw_(st.integers(1 << 12, 1 << 47)),
                length=draw_(st.sampled_from([4096, 65536, 1 << 20])),
                rkey=draw_(st.integers(1, 2**32 - 1)),
                access=draw_(st.sampled_from(_ACCESS)),
            )
            for _ in range(count)
        ]
        return session_pb2.AdvertiseRegionsRequest(session=session, regions=regions)

    return draw()


def _submit_job(world: World) -> st.SearchStrategy[Message]:
    @st.composite
    def draw(draw_: st.DrawFn) -> Message:
        fuzz = world.sessions[draw_(st.integers(0, 1 << 8)) % len(world.sessions)]
        readable, writable, both = (b.name for b in fuzz.buffers)
        size = draw_(st.integers(1, 16)) * 4096

        def ref(choices: list[str], length: int = size) -> common_pb2.RegionRef:
            return common_pb2.RegionRef(region=draw_(st.sampled_from(choices)), length=length)

        src, dst = ref([readable, both]), ref([writable, both])
        sealed = ref([writable, both], min(size + 28, 65536))  # AES-GCM: nonce and tag
        volume = draw_(st.sampled_from([f"volumes/fz-vol-{i}" for i in range(4)]))
        at: dict[str, Any] = {"volume": volume, "offset": draw_(st.integers(0, 240)) * 4096}
        codec: dict[str, Any] = {"format": draw_(st.sampled_from([1, 2]))}
        key: dict[str, Any] = {"key_handle": draw_(st.integers(1, 2))}
        jobs: dict[str, Any] = {
            "copy": job_pb2.CopyJob(source=src, destination=dst),
            "crc32c": job_pb2.Crc32cJob(source=src),
            "volume_write": job_pb2.VolumeWriteJob(source=src, fua=draw_(st.booleans()), **at),
            "volume_read": job_pb2.VolumeReadJob(destination=dst, **at),
            "volume_flush": job_pb2.VolumeFlushJob(volume=volume),
            "volume_trim": job_pb2.VolumeTrimJob(length=size, **at),
            "sha256": job_pb2.Sha256Job(source=src, destination=dst),
            "compress": job_pb2.CompressJob(source=src, destination=dst, **codec),
            "decompress": job_pb2.DecompressJob(source=src, destination=dst, **codec),
            "encrypt": job_pb2.EncryptJob(source=src, destination=sealed, **key),
            "decrypt": job_pb2.DecryptJob(source=src, destination=sealed, **key),
        }
        kind = draw_(st.sampled_from(sorted(jobs)))
        spec = job_pb2.JobSpec(**{kind: jobs[kind]})
        if draw_(st.booleans()):
            spec.deadline.FromMilliseconds(draw_(st.sampled_from([1, 100, 5000])))
        return job_pb2.SubmitJobRequest(
            session=fuzz.name, spec=spec, wait_for_slot=draw_(st.booleans())
        )

    return draw()
