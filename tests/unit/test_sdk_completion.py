"""The SDK's Completion built from a COMPLETION capsule's fields (its hot path) is the
same object the dataclass constructor makes: every field set, none extra."""

from __future__ import annotations

import dataclasses

import pytest

from host_client import Completion

# job_id, state, status, bytes_read, bytes_written, result, submit, start, end, message
SUCCEEDED = (7, 3, 0, 4096, 0, 0x1_2345_6789, 10, 20, 30, "")
FAILED = (8, 4, 3, 0, 0, 99, 10, 20, 30, "source: no region with rkey 0x9")


@pytest.mark.parametrize("crc32c_job", [True, False])
def test_from_fields_equals_the_constructor(crc32c_job):
    made = Completion.from_fields(SUCCEEDED, crc32c_job=crc32c_job)
    expected = Completion(
        job_id=7, state="SUCCEEDED", code="OK", bytes_read=4096,
        crc32c=0x2345_6789 if crc32c_job else None, submit_ns=10, start_ns=20, end_ns=30,
    )  # fmt: skip
    assert made == expected
    assert hash(made) == hash(expected)
    assert set(vars(made)) == {field.name for field in dataclasses.fields(Completion)}


def test_a_failed_job_has_its_code_and_message_and_no_crc():
    made = Completion.from_fields(FAILED, crc32c_job=True)
    assert (made.state, made.code, made.message, made.crc32c) == (
        "FAILED", "INVALID_ARGUMENT", "source: no region with rkey 0x9", None,
    )  # fmt: skip
    assert not made.ok


def test_it_stays_frozen():
    made = Completion.from_fields(SUCCEEDED, crc32c_job=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.state = "FAILED"  # type: ignore[misc]
