"""VLAN ids and VNIs in flow rules: the operator's grants (`[network] tenant_tags_file`)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dpu_agent import config
from dpu_agent.config import ConfigError
from dpu_agent.network import tags

GOOD = """
[tenant.tenant-a]
vlans = [100, "200-299", " 300 - 301 "]
vnis = ["5000-5099", 0, 16777215]

[tenant.tenant-b]
vlans = [4094]
"""


def write(tmp_path: Path, text: str, mode: int = 0o644) -> Path:
    path = tmp_path / "tags.toml"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_a_tags_file_grants_ids_and_ranges(tmp_path):
    granted = tags.load(write(tmp_path, GOOD))
    a = granted.of("tenant-a")
    assert [v for v in (99, 100, 101, 199, 200, 299, 300, 301, 302) if v in a.vlans] == [
        100,
        200,
        299,
        300,
        301,
    ]
    assert str(a.vlans) == "100, 200-299, 300-301"
    vnis = (0, 1, 4999, 5000, 5099, 5100, 16777215)
    assert [v for v in vnis if v in a.vnis] == [0, 5000, 5099, 16777215]
    assert 4094 in granted.of("tenant-b").vlans
    assert str(granted.of("tenant-b").vnis) == "none"
    assert granted.of("tenant-c") == tags.TagGrant()  # not listed: nothing


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[tenant.a]\nvlans = ["200-100"]\n', r"tenant\.a\.vlans\[0\]: '200-100' is not an id"),
        ('[tenant.a]\nvlans = ["1-2-3"]\n', r"vlans\[0\]: '1-2-3' is not an id"),
        ('[tenant.a]\nvlans = ["ten"]\n', r"vlans\[0\]: 'ten' is not an id"),
        ('[tenant.a]\nvlans = [""]\n', r"vlans\[0\]: '' is not an id"),
        ('[tenant.a]\nvlans = ["-5"]\n', r"vlans\[0\]: '-5' is not an id"),
        ("[tenant.a]\nvlans = [1.5]\n", r"vlans\[0\]: expected an id or a range"),
        ("[tenant.a]\nvlans = [true]\n", r"vlans\[0\]: expected an id or a range"),
        ("[tenant.a]\nvlans = [0]\n", r"vlans\[0\]: 0 is not an id or a range .* in 1\.\.4094"),
        ("[tenant.a]\nvlans = [10, 4095]\n", r"vlans\[1\]: 4095 is not .* in 1\.\.4094"),
        ('[tenant.a]\nvlans = ["4000-4095"]\n', r"'4000-4095' is not .* in 1\.\.4094"),
        ("[tenant.a]\nvnis = [-1]\n", r"vnis\[0\]: -1 is not .* in 0\.\.16777215"),
        ("[tenant.a]\nvnis = [16777216]\n", r"vnis\[0\]: 16777216 is not .* in 0\.\.16777215"),
        ('[tenant.a]\nvnis = ["99999999999"]\n', r"vnis\[0\]: '99999999999' is not an id"),
        ('[tenant.a]\nvlans = "100"\n', r"tenant\.a\.vlans: expected a list"),
        ("[tenant.a]\nvlan = [100]\n", r"tenant\.a: unknown key 'vlan' \(expected vlans, vnis\)"),
        ("[tenants.a]\nvlans = [100]\n", r"unknown key 'tenants' \(expected \[tenant\.<name>\]\)"),
        ("tenant = 5\n", r"tenant must be a table"),
        ("[tenant]\na = 5\n", r"tenant\.a: must be a table"),
        ("[tenant.Tenant_A]\nvlans = [100]\n", r"tenant\.Tenant_A: .*tenant"),
        ("[tenant.a\nvlans = [100]\n", r"invalid TOML"),
        (f"[tenant.a]\nvlans = [{', '.join(['1'] * 1025)}]\n", r"at most 1024"),
    ],
)
def test_a_malformed_tags_file_is_a_config_error_naming_the_entry(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        tags.load(write(tmp_path, text))


def test_a_tags_file_others_may_write_or_that_is_missing_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="may be written by group or others"):
        tags.load(write(tmp_path, GOOD, mode=0o666))
    with pytest.raises(ConfigError, match="cannot read"):
        tags.load(tmp_path / "missing.toml")


def test_the_setting_names_the_file_and_the_agent_reads_it(tmp_path):
    path = write(tmp_path, GOOD)
    cfg_file = tmp_path / "agent.toml"
    cfg_file.write_text(f'[network]\ntenant_tags_file = "{path}"\n')
    cfg = config.load(cfg_file, environ={})
    assert cfg.network_tenant_tags_file == str(path)
    assert 100 in tags.from_config(cfg).of("tenant-a").vlans
    env = {"DPU_AGENT_NETWORK_TENANT_TAGS_FILE": str(tmp_path / "missing.toml")}
    with pytest.raises(ConfigError, match=r"^network\.tenant_tags_file: .*cannot read"):
        tags.from_config(config.load(None, environ=env))
    assert tags.from_config(config.load(None, environ={})) == tags.TenantTags()


def test_check_config_reads_the_tags_file_as_the_agent_would(tmp_path):
    cfg_file = tmp_path / "agent.toml"
    cfg_file.write_text(
        f'[tls]\nplaintext_loopback = true\n[network]\ntenant_tags_file = "{tmp_path}/tags.toml"\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("DPU_AGENT_")}

    def check_config() -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "dpu_agent", "check-config", "-c", str(cfg_file)]
        return subprocess.run(
            command, capture_output=True, text=True, timeout=60, check=False, env=env
        )

    write(tmp_path, GOOD)
    done = check_config()
    assert done.returncode == 0, done.stderr
    assert "# tenant tags: 2 tenant(s) granted VLAN ids or VNIs" in done.stdout
    write(tmp_path, '[tenant.a]\nvlans = ["5000"]\n')
    done = check_config()
    assert done.returncode == 2
    assert "configuration error: network.tenant_tags_file: " in done.stderr
    assert "tenant.a.vlans[0]: '5000' is not an id" in done.stderr
