"""`engine.os_errors`: what an OSError from the backing storage becomes."""

import errno

import pytest

from dpu_agent.errors import ResourceExhausted, Unavailable
from dpu_agent.storage.engine import os_errors
from dpu_agent.storage.errors import DataCorruption


@pytest.mark.parametrize(
    ("code", "mapped", "text"),
    [
        (errno.ENOSPC, ResourceExhausted, "no space left for volume data"),
        (errno.EDQUOT, ResourceExhausted, "no space left for volume data"),
        (errno.EIO, DataCorruption, "reported an I/O error"),
        (errno.EROFS, Unavailable, "volume storage failed"),
    ],
)
def test_an_os_error_becomes_its_domain_error(code, mapped, text):
    with pytest.raises(mapped, match=text) as caught, os_errors():
        raise OSError(code, "strerror")
    assert isinstance(caught.value.__cause__, OSError)


def test_other_errors_pass_and_nothing_raised_is_nothing():
    with pytest.raises(KeyError), os_errors():
        raise KeyError("x")
    with os_errors():
        pass
