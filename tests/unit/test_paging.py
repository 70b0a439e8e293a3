import pytest

from dpu_agent import paging
from dpu_agent.errors import InvalidArgument


def test_pages_follow_each_other_in_key_order():
    items = [f"v{i:03d}" for i in range(250)][::-1]
    seen, token = [], ""
    while True:
        chunk, token = paging.page(items, str, 100, token)
        seen += chunk
        if not token:
            break
    assert seen == sorted(items)


def test_size_default_and_cap():
    items = [str(i).zfill(4) for i in range(1000)]
    assert len(paging.page(items, str, 0, "")[0]) == paging.DEFAULT_PAGE_SIZE
    assert len(paging.page(items, str, 10_000, "")[0]) == paging.MAX_PAGE_SIZE


def test_a_foreign_token_is_refused():
    with pytest.raises(InvalidArgument, match="not one this agent issued"):
        paging.page(["a"], str, 1, "%%%")
