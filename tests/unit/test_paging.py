import base64

import pytest

from dpu_agent import paging
from dpu_agent.errors import InvalidArgument
from dpu_wire.v1 import job_pb2, session_pb2, storage_pb2


def volumes(size=0, token=""):
    return storage_pb2.ListVolumesRequest(page_size=size, page_token=token)


def test_pages_follow_each_other_in_key_order():
    items = [f"v{i:03d}" for i in range(250)][::-1]
    seen, token = [], ""
    while True:
        chunk, token = paging.page(items, str, volumes(100, token))
        seen += chunk
        if not token:
            break
    assert seen == sorted(items)


def test_size_default_and_cap():
    items = [str(i).zfill(4) for i in range(1000)]
    assert len(paging.page(items, str, volumes(0))[0]) == paging.DEFAULT_PAGE_SIZE
    assert len(paging.page(items, str, volumes(10_000))[0]) == paging.MAX_PAGE_SIZE


@pytest.mark.parametrize(
    "token",
    [
        "%%%",
        base64.urlsafe_b64encode(b"v001").decode(),  # the old format: the bare last key
        base64.urlsafe_b64encode(b"\x01" + b"\0" * 12).decode(),  # no key
    ],
)
def test_a_foreign_token_is_refused(token):
    with pytest.raises(InvalidArgument, match="not one this agent issued"):
        paging.page(["a"], str, volumes(1, token))


def test_the_page_size_may_change_between_pages():
    items = [f"v{i}" for i in range(5)]
    first, token = paging.page(items, str, volumes(1))
    rest, end = paging.page(items, str, volumes(10, token))
    assert first + rest == items
    assert end == ""


def test_a_token_is_opaque():
    _, token = paging.page(["vol-a", "vol-b"], str, volumes(1))
    assert "vol-a" not in token
    assert token == paging.page(["vol-a", "vol-b"], str, volumes(1))[1]  # deterministic


@pytest.mark.parametrize(
    ("issuer", "elsewhere"),
    [
        (volumes(1), storage_pb2.ListSnapshotsRequest()),  # another method
        (volumes(1), session_pb2.ListSessionsRequest()),  # the same fields, another method
        (
            storage_pb2.ListSnapshotsRequest(page_size=1),
            storage_pb2.ListSnapshotsRequest(source_volume="volumes/a"),  # another filter
        ),
    ],
    ids=["ListSnapshots", "ListSessions", "filter"],
)
def test_a_token_is_refused_by_another_request(issuer, elsewhere):
    _, token = paging.page(["a", "b"], str, issuer)
    elsewhere.page_token = token
    with pytest.raises(InvalidArgument, match="another request"):
        paging.page(["a", "b"], str, elsewhere)


def test_a_list_jobs_token_is_bound_to_its_session_and_state():
    asked = job_pb2.ListJobsRequest(session="sessions/s-1", page_size=1)
    _, token = paging.page(["1", "2"], str, asked)
    for other in (
        job_pb2.ListJobsRequest(session="sessions/s-2"),
        job_pb2.ListJobsRequest(session="sessions/s-1", state=job_pb2.JOB_STATE_FAILED),
    ):
        other.page_token = token
        with pytest.raises(InvalidArgument, match="another request"):
            paging.page(["1", "2"], str, other)
    asked.page_token = token
    assert paging.page(["1", "2"], str, asked) == (["2"], "")


def test_a_request_without_paging_fields_is_a_bug():
    with pytest.raises(TypeError):
        paging.page([], str, job_pb2.GetJobRequest())
