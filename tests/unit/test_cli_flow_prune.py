"""`dpuctl flow apply --prune` deletes the caller's own rules, not every tenant's.

An admin lists every tenant's rules; the old `--prune` planned to delete all of
them that the file did not name (outside audit, r08). Here the SDK client is a
fake that lists rules of two tenants, as the agent answers an admin.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Self

import pytest

from dpu_wire.v1 import network_pb2
from host_client import _certs, cli
from host_client._cli_network import plan

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from host_client._tls import TlsConfig


def _rule(name: str, tenant: str) -> network_pb2.FlowRule:
    return network_pb2.FlowRule(
        name=f"flowRules/{name}",
        ingress_port="ports/pf0vf0",
        priority=5,
        actions=[network_pb2.FlowAction(drop=network_pb2.DropAction())],
        tenant=tenant,
    )


RULES = [_rule("mine", "default"), _rule("ops-web", "ops"), _rule("b-web", "tenant-b")]


class AdminView:
    """The calls of `flow apply`, answered as the agent answers an admin."""

    applied: list[list[str]]

    def __init__(self, *_args: object, tls: TlsConfig | None = None, **_kwargs: object) -> None:
        self.tls = tls or None
        AdminView.applied = []

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        pass

    async def list_flow_rules(self, _port: str = "") -> list[network_pb2.FlowRule]:
        return list(RULES)

    async def apply_flow_rules(
        self,
        _creates: list[network_pb2.FlowRule],
        _updates: list[network_pb2.FlowRule],
        deletes: list[str],
        *,
        validate_only: bool = False,
    ) -> None:
        assert validate_only
        AdminView.applied.append(deletes)


@pytest.fixture
def apply(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> Callable[..., tuple[str, list[list[str]]]]:
    monkeypatch.setattr(cli, "Client", AdminView)
    monkeypatch.delenv("DPU_TOKEN", raising=False)
    for name in ("DPU_TLS_CA", "DPU_TLS_CERT", "DPU_TLS_KEY"):
        monkeypatch.delenv(name, raising=False)
    empty = tmp_path / "rules.json"
    empty.write_text(json.dumps({"rules": []}))

    def run(*options: str, tenant: str = "") -> tuple[str, list[list[str]]]:
        chosen = ["--tenant", tenant] if tenant else []
        argv = [*options, "flow", "apply", "--prune", "--dry-run", *chosen, str(empty)]
        assert cli.main(argv) == 0
        return capsys.readouterr().out, AdminView.applied

    return run


def test_plan_prunes_only_the_given_tenants_rules() -> None:
    assert plan(RULES, [], [], prune="ops") == ([], [], ["flowRules/ops-web"])
    assert plan(RULES, [], [], prune="nobody") == ([], [], [])
    assert plan(RULES, [], [], prune=None) == ([], [], [])


def test_the_local_admin_prunes_its_own_rules_only(
    apply: Callable[..., tuple[str, list[list[str]]]],
) -> None:
    out, applied = apply("--plaintext")  # plaintext loopback, no token: tenant "default"
    assert applied == [["flowRules/mine"]]
    assert "- flowRules/mine" in out
    assert "b-web" not in out
    assert "0 to create, 0 to update, 1 to delete" in out


def test_an_admin_certificate_prunes_its_tenants_rules_only(
    apply: Callable[..., tuple[str, list[list[str]]]], tmp_path: Path
) -> None:
    _certs.make_ca(tmp_path)
    cert, key = _certs.make_client(tmp_path, "ops", admin=True)
    ca = tmp_path / "ca.pem"
    _out, applied = apply("--ca", str(ca), "--cert", str(cert), "--key", str(key))
    assert applied == [["flowRules/ops-web"]]


def test_tenant_names_whose_rules_an_admin_prunes(
    apply: Callable[..., tuple[str, list[list[str]]]],
) -> None:
    _out, applied = apply("--plaintext", tenant="tenant-b")
    assert applied == [["flowRules/b-web"]]


def test_a_bearer_token_needs_tenant(
    apply: Callable[..., tuple[str, list[list[str]]]],
) -> None:
    with pytest.raises(SystemExit, match="needs --tenant"):
        apply("--token", "secret")
    _out, applied = apply("--token", "secret", tenant="ops")
    assert applied == [["flowRules/ops-web"]]


def test_help_says_whose_rules_are_pruned(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["flow", "apply", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--prune deletes the rules of one tenant only" in text
    assert "your tenant's only, admins too" in text
