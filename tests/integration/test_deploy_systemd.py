"""The systemd unit's command lines, run as systemd runs them (its sandbox aside).

`make lint-deploy` has systemd-analyze check deploy/systemd/dpu-agent.service; this runs
its ExecStart and ExecStartPost for real with the sample deploy/systemd/agent.toml (TLS
files from a lab PKI, loopback port 0 instead of 0.0.0.0:50051): the agent serves mTLS,
writes the ready file that ExecStartPost waits for, answers the health check and exits 0
on SIGTERM; an agent that refuses its configuration exits 2 (RestartPreventExitStatus)
and ExecStartPost gives up instead of waiting for ever.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.pki import LabPki, make_pki

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "deploy" / "systemd" / "dpu-agent.service"
SAMPLE = REPO / "deploy" / "systemd" / "agent.toml"
VENV_BIN = Path(sys.executable).parent
TIMEOUT = 120.0  # hang guard only


def service_setting(key: str) -> str:
    """One [Service] setting of the unit, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", UNIT.read_text())
    section = text.split("[Service]", 1)[1].split("\n[", 1)[0]
    values = [line.split("=", 1)[1] for line in section.splitlines() if line.startswith(f"{key}=")]
    assert len(values) == 1, f"{key}= appears {len(values)} times in {UNIT}"
    return values[0]


def command(key: str, runtime: Path, config: Path) -> list[str]:
    """ExecStart/ExecStartPost with systemd's substitutions made for this checkout."""
    line = (
        service_setting(key)
        .replace("%t", str(runtime))
        .replace("$$", "$")
        .replace("/opt/dpu-agent/venv/bin/", f"{VENV_BIN}/")
        .replace("/etc/dpu-agent/agent.toml", str(config))
    )
    return shlex.split(line)


@pytest.fixture
def unit_env(tmp_path: Path) -> tuple[Path, Path, dict[str, str], LabPki]:
    pki = make_pki(tmp_path / "pki")
    config = tmp_path / "agent.toml"
    config.write_text(SAMPLE.read_text().replace("/etc/dpu-agent/tls/", f"{pki.directory}/"))
    runtime = tmp_path / "run"
    (runtime / "dpu-agent").mkdir(parents=True)  # RuntimeDirectory=dpu-agent
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DPU_AGENT_", "DPU_TLS"))}
    env |= {
        "STATE_DIRECTORY": str(tmp_path / "state"),  # StateDirectory=dpu-agent
        "DPU_AGENT_LISTEN": "127.0.0.1:0",
        "DPU_AGENT_METRICS_LISTEN": "127.0.0.1:0",
    }
    return runtime, config, env, pki


@pytest.mark.slow
def test_the_unit_starts_serves_and_stops(
    tmp_path: Path, unit_env: tuple[Path, Path, dict[str, str], LabPki]
) -> None:
    runtime, config, env, pki = unit_env
    start = command("ExecStart", runtime, config)
    assert start[:2] == [str(VENV_BIN / "dpu-agent"), "serve"]
    log = (tmp_path / "agent.log").open("wb")
    agent = subprocess.Popen(start, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        post = subprocess.run(
            command("ExecStartPost", runtime, config),
            env=env | {"MAINPID": str(agent.pid)},
            timeout=TIMEOUT,
            check=False,
        )
        assert post.returncode == 0, (tmp_path / "agent.log").read_text()
        address = (runtime / "dpu-agent" / "ready").read_text().strip()
        assert re.fullmatch(r"127\.0\.0\.1:\d+", address)
        health = subprocess.run(
            [str(VENV_BIN / "dpuctl"), "--target", address, *pki.cli_args("probe"), "health"],
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            check=False,
        )
        assert (health.returncode, health.stdout.strip()) == (0, "SERVING"), health.stderr
        agent.send_signal(signal.SIGTERM)
        stop_timeout = float(service_setting("TimeoutStopSec"))
        assert agent.wait(timeout=stop_timeout) == 0
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        log.close()


@pytest.mark.slow
def test_a_refused_configuration_exits_2_and_ready_wait_gives_up(
    unit_env: tuple[Path, Path, dict[str, str], LabPki],
) -> None:
    runtime, config, env, pki = unit_env
    (pki.directory / "agent.key").chmod(0o644)  # the agent refuses a key others can read
    agent = subprocess.Popen(
        command("ExecStart", runtime, config),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    _, stderr = agent.communicate(timeout=TIMEOUT)
    assert agent.returncode == int(service_setting("RestartPreventExitStatus"))
    assert b"it must be 0600" in stderr
    # systemd reaps the main process at once; the wait loop must then stop, not spin.
    post = subprocess.run(
        command("ExecStartPost", runtime, config),
        env=env | {"MAINPID": str(agent.pid)},
        capture_output=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert post.returncode == 1
    assert not (runtime / "dpu-agent" / "ready").exists()
