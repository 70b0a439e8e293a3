"""The capsule wire format: layout, round trips, and a fuzzed parser."""

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpu_wire import capsule
from dpu_wire.capsule import CapsuleError, JobKind, Span, State

U32 = st.integers(0, capsule.U32_MAX)
U64 = st.integers(0, capsule.U64_MAX)
spans = st.builds(Span, U64, U32, U32)


def test_layout_is_fixed_little_endian():
    data = capsule.Submit(
        job_id=0x0102030405060708,
        kind=JobKind.COPY,
        source=Span(0x1000, 4096, 0xAABBCCDD),
        destination=Span(0x2000, 4096, 0x11223344),
        deadline_ms=250,
    ).encode()
    assert len(data) == 80
    assert data[:4] == b"DC\x01\x01"
    assert struct.unpack_from("<I", data, 4)[0] == 80
    assert data[8:16] == bytes.fromhex("0807060504030201")
    assert struct.unpack_from("<HHI", data, 16) == (1, 0, 250)
    assert struct.unpack_from("<QII", data, 24) == (0x1000, 4096, 0xAABBCCDD)


@given(U64, st.sampled_from(list(JobKind)), spans, spans, U32, U64, U32, U64, st.booleans())
def test_submit_round_trips(
    job_id, kind, source, destination, deadline, offset, volume, length, fua
):
    flags = capsule.FLAG_FUA if fua and kind == JobKind.VOLUME_WRITE else 0
    message = capsule.Submit(
        job_id, kind, source, destination, deadline, offset, volume, length, flags
    )
    assert capsule.decode(message.encode()) == message


def test_volume_fields_sit_where_the_spec_says():
    data = capsule.Submit(
        5, JobKind.VOLUME_TRIM, Span(), offset=4096, handle=3, length=8192
    ).encode()
    assert struct.unpack_from("<QIIQ", data, 56) == (4096, 3, 0, 8192)


def test_fua_is_only_for_volume_writes():
    data = bytearray(capsule.Submit(5, JobKind.VOLUME_WRITE, Span(), flags=1).encode())
    decoded = capsule.decode(bytes(data))
    assert isinstance(decoded, capsule.Submit)
    assert decoded.flags == capsule.FLAG_FUA
    data[16] = JobKind.VOLUME_READ
    with pytest.raises(CapsuleError, match="reserved flags"):
        capsule.decode(bytes(data))


@given(
    U64,
    st.sampled_from(list(State)),
    st.integers(0, 0xFFFF),
    U64,
    U64,
    U64,
    st.text(max_size=capsule.MAX_MESSAGE),
)
def test_completion_round_trips(job_id, state, code, read, written, result, message):
    encoded = capsule.Completion(
        job_id, state, code, read, written, result, 1, 2, 3, message
    ).encode()
    assert len(encoded) <= capsule.MAX_CAPSULE
    decoded = capsule.decode(encoded)
    assert isinstance(decoded, capsule.Completion)
    assert (decoded.job_id, decoded.state, decoded.status) == (job_id, state, code)
    assert (
        message.encode()[: capsule.MAX_MESSAGE]
        .decode(errors="ignore")
        .startswith(decoded.message[:10])
        or not message
    )


def test_cancel_round_trips():
    assert capsule.decode(capsule.Cancel(42).encode()) == capsule.Cancel(42)


def good_submit():
    return bytearray(capsule.Submit(job_id=9, kind=JobKind.CRC32C, source=Span(1, 2, 3)).encode())


@pytest.mark.parametrize(
    ("mutate", "message", "job_id"),
    [
        (lambda b: b[:10], "shorter than the 16-byte header", 0),
        (lambda b: b"XX" + b[2:], "bad magic", 0),
        (lambda b: b[:2] + b"\x02" + b[3:], "unsupported capsule version 2", 9),
        (lambda b: b[:3] + b"\x09" + b[4:], "unknown opcode 9", 9),
        (lambda b: b[:16] + b"\x63\x00" + b[18:], "unknown job kind 99", 9),
        (lambda b: b[:18] + b"\x01\x00" + b[20:], "reserved flags", 9),
        (lambda b: b + b"\x00", "header says 80 bytes but the capsule has 81", 9),
        (lambda b: b[:4] + struct.pack("<I", 60) + b[8:60], "must be 80 bytes", 9),
        (lambda b: b[:68] + b"\x01" + b[69:], "reserved field", 9),
    ],
)
def test_bad_capsules_name_the_problem_and_keep_the_job_id(mutate, message, job_id):
    with pytest.raises(CapsuleError, match=message) as info:
        capsule.decode(bytes(mutate(good_submit())))
    assert info.value.job_id == job_id


def test_encoding_refuses_values_that_do_not_fit():
    with pytest.raises(ValueError, match="32 bits"):
        capsule.Submit(1, JobKind.COPY, Span(0, 1 << 32, 0)).encode()
    with pytest.raises(ValueError, match="64 bits"):
        capsule.Cancel(-1).encode()


@settings(max_examples=5000, deadline=None)
@given(st.binary(max_size=300))
def test_fuzz_decode_never_crashes(data):
    try:
        result = capsule.decode(data)
    except CapsuleError:
        return
    assert isinstance(result, capsule.Submit | capsule.Cancel | capsule.Completion)


@settings(max_examples=3000, deadline=None)
@given(st.binary(min_size=80, max_size=80))
def test_fuzz_headers_that_look_right(tail):
    data = b"DC\x01\x01" + struct.pack("<I", 80) + tail[8:]
    error: CapsuleError | None = None
    try:
        result = capsule.decode(data)
    except CapsuleError as exc:
        error = exc
    if error is not None:
        assert error.job_id == struct.unpack_from("<Q", data, 8)[0]
    else:
        assert isinstance(result, capsule.Submit)
