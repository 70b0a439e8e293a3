"""`dpuctl` and `dpu-agent` as a user runs them, against a real agent process."""

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

import host_client

BIN = Path(sys.executable).parent


def run(*args, timeout=60):
    return subprocess.run(
        [str(BIN / args[0]), *args[1:]],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture(scope="module", autouse=True)
def scripts_installed():
    assert (BIN / "dpuctl").exists(), "dpuctl is not installed in the virtualenv"
    assert (BIN / "dpu-agent").exists(), "dpu-agent is not installed in the virtualenv"


def test_info_text(agent):
    proc = run("dpuctl", "--target", agent.address, "info")
    assert proc.returncode == 0, proc.stderr
    assert "agent       agents/" in proc.stdout
    assert "dpu.v1.StorageService" in proc.stdout
    assert "unavailable:" in proc.stdout


def test_info_json_is_the_api_message(agent):
    proc = run("dpuctl", "--target", agent.address, "--json", "info")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["api_version"] == "dpu.v1"
    assert {c["service"] for c in info["capabilities"]} >= {"dpu.v1.AgentService"}


def test_health_exit_codes(agent):
    proc = run("dpuctl", "--target", agent.address, "health", "--wait", "5")
    assert (proc.returncode, proc.stdout.strip()) == (0, "SERVING")
    proc = run("dpuctl", "--target", agent.address, "health", "--service", "no.Such")
    assert (proc.returncode, proc.stdout.strip()) == (4, "SERVICE_UNKNOWN")


def test_target_from_environment(agent, monkeypatch):
    monkeypatch.setenv("DPU_TARGET", agent.address)
    proc = run("dpuctl", "health")
    assert proc.returncode == 0, proc.stderr


def test_unreachable_agent_is_one_clear_line():
    proc = run("dpuctl", "--target", "127.0.0.1:1", "--timeout", "5", "info")
    assert proc.returncode == 1
    assert proc.stderr.startswith("dpuctl: UNAVAILABLE")
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "args",
    [("--timeout", "0", "info"), ("--timeout", "soon", "info"), ("nosuchcommand",), ()],
)
def test_usage_errors_exit_2_without_traceback(args):
    proc = run("dpuctl", *args)
    assert proc.returncode == 2
    assert "usage:" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_help_texts_list_commands_and_environment():
    assert "info" in run("dpuctl", "--help").stdout
    serve_help = run("dpu-agent", "serve", "--help").stdout
    for env in (
        "DPU_AGENT_LISTEN",
        "DPU_AGENT_ID",
        "DPU_AGENT_LOG_LEVEL",
        "DPU_AGENT_GRACE_PERIOD",
    ):
        assert env in serve_help


def test_agent_refuses_a_busy_port_clearly(agent):
    proc = run("dpu-agent", "serve", "--plaintext-loopback", "--listen", agent.address)
    assert proc.returncode == 1
    assert f"cannot listen on {agent.address}" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.asyncio
async def test_session_and_job_commands(agent):
    async with (
        host_client.Client(agent.address) as client,
        await client.open_session(transport="tcp", label="cli-test") as session,
    ):
        src = await session.alloc(4096, readable=True)
        job = await session.submit_rpc("crc32c", src)
        done = await job
        listing = await asyncio.to_thread(run, "dpuctl", "-t", agent.address, "session", "list")
        assert listing.returncode == 0, listing.stderr
        assert session.name in listing.stdout
        assert "cli-test" in listing.stdout
        jobs = await asyncio.to_thread(
            run, "dpuctl", "-t", agent.address, "job", "list", session.name
        )
        assert f"{session.name}/jobs/{job.job_id}" in jobs.stdout
        assert f"crc32c {done.crc32c:#010x}" in jobs.stdout
        name = f"{session.name}/jobs/{job.job_id}"
        got = await asyncio.to_thread(
            run, "dpuctl", "-t", agent.address, "--json", "job", "get", name
        )
        assert json.loads(got.stdout)["state"] == "JOB_STATE_SUCCEEDED"
        missing = await asyncio.to_thread(
            run, "dpuctl", "-t", agent.address, "job", "get", f"{session.name}/jobs/999"
        )
        assert missing.returncode == 1
        assert missing.stderr.startswith("dpuctl: NOT_FOUND")
        closed = await asyncio.to_thread(
            run, "dpuctl", "-t", agent.address, "session", "close", session.name
        )
        assert closed.returncode == 0, closed.stderr
        after = await asyncio.to_thread(run, "dpuctl", "-t", agent.address, "session", "list")
        assert session.name not in after.stdout
