import importlib.util
import sys
from pathlib import Path

import grpc
import pytest

import host_client
from dpu_agent import errors
from dpu_agent.status import FOR_OTHER_ERRORS, OTHER_CODES, STATUS_FOR, code_for, status_for
from host_client._errors import _ERROR_FOR


def test_every_domain_error_has_a_status():
    domain = {
        cls
        for cls in vars(errors).values()
        if isinstance(cls, type) and issubclass(cls, errors.AgentError)
    }
    domain.discard(errors.AgentError)
    assert domain == set(STATUS_FOR)


def test_subclass_of_a_domain_error_maps_like_its_base():
    class VolumeMissing(errors.NotFound):
        pass

    assert status_for(VolumeMissing("x")) == grpc.StatusCode.NOT_FOUND
    assert status_for(errors.AgentError("x")) == grpc.StatusCode.UNKNOWN


@pytest.mark.parametrize("code", list(grpc.StatusCode))
def test_every_status_maps_to_a_typed_sdk_error(code):
    if code == grpc.StatusCode.OK:
        return
    cls = _ERROR_FOR.get(code, host_client.InternalError)
    assert issubclass(cls, host_client.DpuError)
    assert cls.__name__ in host_client.__all__


def test_agent_statuses_round_trip_to_sdk_errors():
    expected = {
        grpc.StatusCode.INVALID_ARGUMENT: host_client.InvalidArgumentError,
        grpc.StatusCode.NOT_FOUND: host_client.NotFoundError,
        grpc.StatusCode.ALREADY_EXISTS: host_client.AlreadyExistsError,
        grpc.StatusCode.FAILED_PRECONDITION: host_client.FailedPreconditionError,
        grpc.StatusCode.RESOURCE_EXHAUSTED: host_client.ResourceExhaustedError,
        grpc.StatusCode.PERMISSION_DENIED: host_client.PermissionDeniedError,
        grpc.StatusCode.UNAUTHENTICATED: host_client.PermissionDeniedError,
        grpc.StatusCode.UNAVAILABLE: host_client.UnavailableError,
        grpc.StatusCode.DEADLINE_EXCEEDED: host_client.DeadlineExceededError,
        grpc.StatusCode.CANCELLED: host_client.CancelledError,
        grpc.StatusCode.DATA_LOSS: host_client.DataLossError,
        grpc.StatusCode.UNIMPLEMENTED: host_client.UnimplementedError,
    }
    for code in STATUS_FOR.values():
        assert _ERROR_FOR[code] is expected[code]


def test_completion_codes_use_the_same_numbers():
    assert code_for(errors.NotFound("x")) == grpc.StatusCode.NOT_FOUND.value[0]
    assert code_for(RuntimeError("boom")) == grpc.StatusCode.INTERNAL.value[0]


def test_docs_api_md_lists_every_code_the_agent_answers(monkeypatch):
    """gen_api_docs.py writes its table from the live mapping: every code, none more."""
    path = Path(__file__).resolve().parents[2] / "scripts" / "gen_api_docs.py"
    spec = importlib.util.spec_from_file_location("gen_api_docs", path)
    assert spec is not None
    assert spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, gen)  # its dataclasses look themselves up
    spec.loader.exec_module(gen)
    rows = {row.name: row.error for row in gen.status_rows()}
    expected = {code.name: cls.__name__ for cls, code in STATUS_FOR.items()}
    assert rows == expected | {code.name: "" for code in OTHER_CODES}
    assert FOR_OTHER_ERRORS in OTHER_CODES
    api_md = (path.parents[1] / "docs" / "api.md").read_text()
    assert "## Status codes" in api_md
    assert "`UNAUTHENTICATED` | 16 |" in api_md
