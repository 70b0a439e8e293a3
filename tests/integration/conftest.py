"""Fixtures that run the real agent as a separate process on a loopback port.

`start_agent` serves plaintext on loopback (`[tls] plaintext_loopback`, every caller
the local admin) unless given a lab PKI (`tests.integration.pki`): then it serves
mTLS, and clients need `pki.client(tenant)`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
    from tests.integration.pki import LabPki

START_TIMEOUT = 120.0  # a hang guard; agents start slowly in the TCG test VM under load


@dataclasses.dataclass
class AgentProcess:
    """A running `dpu-agent serve` and where to find its output."""

    proc: subprocess.Popen[bytes]
    address: str
    log_path: Path

    def log_entries(self) -> list[dict[str, object]]:
        """The agent's JSON log lines so far."""
        entries = []
        for line in self.log_path.read_text().splitlines():
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError:
                entries.append({"raw": line})
        return entries

    def metrics_url(self) -> str:
        """The agent's Prometheus endpoint, from its "metrics serving" log line."""
        for entry in self.log_entries():
            if entry.get("msg") == "metrics serving":
                return str(entry["url"])
        raise RuntimeError(f"the agent serves no metrics: {self.log_path.read_text()}")

    def metrics(self) -> dict[str, float]:
        """Scrape the agent over HTTP: {'dpu_agent_sessions_open{transport="tcp"}': 1.0, ...}.

        Keys are written as in the exposition format, labels sorted by name.
        """
        with urllib.request.urlopen(self.metrics_url(), timeout=10) as reply:  # noqa: S310
            text = reply.read().decode()
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return samples

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM the agent and return its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)


def start_agent(
    tmp_path: Path,
    *args: str,
    program: tuple[str, ...] = (sys.executable, "-m", "dpu_agent"),
    env: dict[str, str] | None = None,
    pki: LabPki | None = None,
) -> AgentProcess:
    """Start an agent process listening on a free loopback port and wait until it serves.

    Plaintext (the local admin for every caller) unless `pki` is given: then mTLS.
    """
    ready = tmp_path / f"ready-{time.monotonic_ns()}"
    log_path = tmp_path / f"agent-{time.monotonic_ns()}.log"
    cmd = [*program, "serve", "--listen", "127.0.0.1:0"]
    cmd += ["--ready-file", str(ready), "--log-format", "json", *args]
    volumes = tmp_path / f"volumes-{time.monotonic_ns()}"  # one store directory per agent
    environ = {
        **os.environ,
        "DPU_AGENT_STORAGE_DIR": str(volumes),
        "DPU_AGENT_NETWORK_RULES_FILE": str(volumes) + "-flow-rules.json",
        "DPU_AGENT_METRICS_LISTEN": "127.0.0.1:0",  # its own /metrics port, logged
        "DPU_AGENT_VIRT_STATE_FILE": str(volumes) + "-functions.json",
        **(pki.agent_env() if pki is not None else {"DPU_AGENT_TLS_PLAINTEXT_LOOPBACK": "1"}),
        **(env or {}),
    }
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=environ)
    deadline = time.monotonic() + START_TIMEOUT
    while not ready.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"agent exited with {proc.returncode}: {log_path.read_text()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"agent did not start in {START_TIMEOUT} s: {log_path.read_text()}")
        time.sleep(0.05)
    return AgentProcess(proc, ready.read_text().strip(), log_path)


def tokens_file(
    directory: Path, *tenants: str, admins: tuple[str, ...] = ()
) -> tuple[Path, dict[str, str]]:
    """A tokens file (`[auth] tokens_file`, mode 0600) giving each tenant a new bearer
    token (`admins`: admin tokens); returns its path and the tokens by tenant."""
    from host_client import _certs  # noqa: PLC0415 - the SDK's tool, only where used

    tokens, entries = {}, []
    for tenant in (*tenants, *admins):
        tokens[tenant], entry = _certs.make_token(tenant, admin=tenant in admins)
        entries.append(entry)
    path = directory / "tokens.toml"
    path.touch(mode=0o600)
    path.write_text("\n".join(entries))
    return path, tokens


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory):
    """One agent process shared by a test module; it must exit 0 on SIGTERM."""
    process = start_agent(tmp_path_factory.mktemp("agent"))
    yield process
    assert process.terminate() == 0, process.log_path.read_text()
