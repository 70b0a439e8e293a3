"""Each check of deploy/lint_deploy.py fails on a broken copy of the file it checks.

`make lint-deploy` shows the repository's files pass; these show the same checks
would notice a mistake, with the tool's own message (so a missing tool, which is
also a failure, cannot pass for a caught mistake).
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
_spec = importlib.util.spec_from_file_location("lint_deploy", DEPLOY / "lint_deploy.py")
assert _spec is not None
assert _spec.loader is not None
lint = importlib.util.module_from_spec(_spec)
sys.modules["lint_deploy"] = lint
_spec.loader.exec_module(lint)

TOOLS = lint.Tools()


def joined(result: tuple[str, list[str]]) -> str:
    return "\n".join(result[1])


def test_shellcheck_flags_an_unquoted_variable(tmp_path: Path) -> None:
    script = tmp_path / "broken.sh"
    script.write_text("#!/bin/sh\ndir=$1\nrm -rf $dir/*\n")
    assert lint.shell_scripts([tmp_path]) == [script]
    assert "SC2086" in joined(lint.check_shell(TOOLS, [script]))


def test_systemd_verify_reports_a_bad_setting(tmp_path: Path) -> None:
    unit = tmp_path / "dpu-agent.service"
    text = (DEPLOY / "systemd" / "dpu-agent.service").read_text()
    unit.write_text(text.replace("Type=exec", "Type=sometimes").replace("UMask=", "Umask="))
    problems = joined(lint.check_systemd(TOOLS, unit, DEPLOY / "systemd" / "netns.conf"))
    assert "Failed to parse service type" in problems
    assert "Unknown key" in problems


def test_systemd_security_rejects_a_unit_without_its_sandbox(tmp_path: Path) -> None:
    unit = tmp_path / "dpu-agent.service"
    text = (DEPLOY / "systemd" / "dpu-agent.service").read_text()
    sandbox = ("Protect", "Private", "Restrict", "SystemCall", "Capability", "Device")
    unit.write_text("\n".join(ln for ln in text.splitlines() if not ln.startswith(sandbox)))
    problems = joined(lint.check_systemd(TOOLS, unit, DEPLOY / "systemd" / "netns.conf"))
    assert "security (alone): above 2.5" in problems
    assert "verify" not in problems


def test_hadolint_and_copy_sources(tmp_path: Path) -> None:
    containerfile = tmp_path / "Containerfile"
    containerfile.write_text('FROM debian\nRUN cd /src && make\nCOPY missing.txt /x\nCMD ["x"]\n')
    (tmp_path / "Containerfile.dockerignore").write_text("*\n!README.md\n")
    problems = joined(lint.check_container(TOOLS, containerfile, tmp_path))
    assert "DL3006" in problems  # untagged base image
    assert "DL3003" in problems  # cd instead of WORKDIR
    assert "COPY missing.txt: no such file" in problems
    assert "COPY missing.txt: excluded by" in problems


def test_check_config_rejects_unknown_keys_and_plaintext_off_loopback() -> None:
    problems = joined(
        lint.check_configs(
            TOOLS,
            {
                "typo": '[agent]\nlisten = "127.0.0.1:50051"\nlisen = "x"\n',
                "open": '[agent]\nlisten = "0.0.0.0:50051"\n',
            },
        )
    )
    assert "typo: " in problems
    assert "unknown setting agent.lisen" in problems
    assert "open: " in problems
    assert "not loopback, and no TLS is configured" in problems


def _k8s_copy(tmp_path: Path) -> Path:
    k8s = tmp_path / "k8s"
    shutil.copytree(DEPLOY / "k8s", k8s)
    return k8s


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


def test_kubernetes_schema_strict(tmp_path: Path) -> None:
    k8s = _k8s_copy(tmp_path)
    _edit(
        k8s / "agent-daemonset.yaml",
        "hostNetwork: true",
        "hostNetwork: true\n      hostNetworks: true",
    )
    _edit(k8s / "broker.yaml", "replicas: 1 ", 'replicas: "one" ')
    problems = joined(lint.check_kubernetes(TOOLS, k8s, DEPLOY / "mosquitto" / "dpu.acl"))
    assert "hostNetworks" in problems
    assert "replicas" in problems


def test_kubernetes_references_secrets_and_acl(tmp_path: Path) -> None:
    k8s = _k8s_copy(tmp_path)
    daemonset = k8s / "agent-daemonset.yaml"
    _edit(daemonset, "secretName: dpu-agent-mqtt", "secretName: dpu-agent-mqt")
    _edit(daemonset, "--cert=/etc/dpu-agent/tls/probe.pem", "--cert=/etc/dpu-agent/tls/probe.crt")
    _edit(k8s / "agent-secrets.yaml", '"REPLACE-ME: its private key (PEM)"', '"-----BEGIN KEY"')
    _edit(k8s / "broker-config.yaml", "topic write dpu/v1/agents/#", "topic readwrite #")
    (k8s / "extra.yaml").write_text("apiVersion: v1\nkind: Namespace\nmetadata:\n  name: x\n")
    problems = joined(lint.check_kubernetes(TOOLS, k8s, DEPLOY / "mosquitto" / "dpu.acl"))
    assert "names a missing Secret dpu-agent-mqt" in problems
    assert "/etc/dpu-agent/mqtt/password is not a key" in problems
    assert "/etc/dpu-agent/tls/probe.crt is not a key" in problems
    assert "key agent.key is not a REPLACE-ME placeholder" in problems
    assert "the acl differs" in problems
    assert "kustomization.yaml does not list extra.yaml" in problems


def test_compose_schema_and_references(tmp_path: Path) -> None:
    compose = tmp_path / "compose" / "compose.yaml"
    shutil.copytree(DEPLOY / "compose", compose.parent)
    _edit(compose, "    restart: unless-stopped\n\n  agent:", "    restarts: always\n\n  agent:")
    _edit(compose, "agent-state:/var/lib/dpu-agent", "agent-data:/var/lib/dpu-agent")
    _edit(compose, "      - broker\n", "      - mqtt\n")
    problems = joined(lint.check_compose(TOOLS, compose))
    assert "restarts" in problems
    assert "volume agent-data is not declared" in problems
    assert "depends on an undefined service mqtt" in problems
    assert "bind source ../mosquitto/mosquitto.conf does not exist" in problems


def test_yamllint_on_a_duplicate_key(tmp_path: Path) -> None:
    (tmp_path / ".gitignore").write_text("ignored/\n")
    (tmp_path / "a.yaml").write_text("key: 1\nkey: 2\n")
    (tmp_path / "ignored").mkdir()
    (tmp_path / "ignored" / "b.yaml").write_text("{ not yaml")
    what, problems = lint.check_yaml(TOOLS, tmp_path, DEPLOY / "yamllint.yaml")
    assert what == "1 files"
    assert "duplication of key" in "\n".join(problems)


def test_a_missing_tool_is_a_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    script = tmp_path / "fine.sh"
    script.write_text("#!/bin/sh\necho fine\n")
    _, problems = lint.check_shell(lint.Tools(venv_bin=tmp_path), [script])
    assert problems == ["shellcheck is not installed (make venv installs it)"]
