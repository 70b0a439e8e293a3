import dataclasses
import os
import subprocess
import sys

import pytest

from dpu_agent import config


def write(tmp_path, text):
    path = tmp_path / "agent.toml"
    path.write_text(text)
    return path


def test_defaults_without_file_or_env():
    cfg = config.load(None, environ={})
    assert cfg.listen == "127.0.0.1:50051"
    assert cfg.log_format == "json"
    assert cfg.grace_period == 10.0
    assert cfg.agent_id  # derived from the host name


def test_precedence_file_then_env_then_overrides(tmp_path):
    path = write(
        tmp_path, '[agent]\nid = "from-file"\nlisten = "127.0.0.1:1"\n[log]\nlevel = "debug"\n'
    )
    env = {"DPU_AGENT_LISTEN": "127.0.0.1:2", "DPU_AGENT_GRACE_PERIOD": "2.5"}
    cfg = config.load(path, environ=env, overrides={"agent_id": "from-flag", "log_level": None})
    assert cfg.agent_id == "from-flag"
    assert cfg.listen == "127.0.0.1:2"
    assert cfg.grace_period == 2.5
    assert cfg.log_level == "debug"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[agent\nid = 1", "invalid TOML"),
        ('[agent]\nlistne = "x:1"', "unknown setting agent.listne"),
        ('agent = "x"', r"\[agent\] must be a table"),
        ("[agent]\nid = 5", "expected a string"),
        ('[agent]\nid = "Bad_Id"', "lowercase DNS label"),
        ('[agent]\nid = ""', "agent id is empty"),
        ('[agent]\nlisten = "nowhere"', "not host:port"),
        ('[agent]\nlisten = "h:70000"', "not host:port"),
        ("[agent]\ngrace_period = -1", "between 0 and 3600"),
        ("[agent]\ngrace_period = true", "between 0 and 3600"),
        ('[log]\nlevel = "loud"', "expected one of debug"),
    ],
)
def test_bad_file_is_a_clear_error(tmp_path, text, message):
    with pytest.raises(config.ConfigError, match=message) as info:
        config.load(write(tmp_path, text), environ={})
    assert str(write(tmp_path, text)) in str(info.value)


def test_bad_environment_names_the_variable():
    with pytest.raises(config.ConfigError, match=r"\$DPU_AGENT_GRACE_PERIOD"):
        config.load(None, environ={"DPU_AGENT_GRACE_PERIOD": "soon"})


def test_missing_and_binary_files(tmp_path):
    with pytest.raises(config.ConfigError, match="cannot read"):
        config.load(tmp_path / "absent.toml", environ={})
    binary = tmp_path / "bin.toml"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(config.ConfigError, match="not UTF-8"):
        config.load(binary, environ={})


def test_cli_reports_malformed_config_without_traceback(tmp_path):
    path = write(tmp_path, "[agent\n")
    proc = subprocess.run(
        [sys.executable, "-m", "dpu_agent", "serve", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert "configuration error" in proc.stderr
    assert "invalid TOML" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_check_config_prints_merged_settings(tmp_path):
    path = write(tmp_path, '[agent]\nid = "dpu-7"\n[tls]\nplaintext_loopback = true\n')
    proc = subprocess.run(
        [sys.executable, "-m", "dpu_agent", "check-config", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={k: v for k, v in os.environ.items() if not k.startswith("DPU_AGENT_")},
    )
    assert proc.returncode == 0, proc.stderr
    assert "agent_id = 'dpu-7'" in proc.stdout
    assert "# security: plaintext on loopback; every caller is the local admin" in proc.stdout


def test_cli_check_config_refuses_what_serve_would_refuse(tmp_path):
    path = write(tmp_path, '[agent]\nid = "dpu-7"\n')
    proc = subprocess.run(
        [sys.executable, "-m", "dpu_agent", "check-config", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={k: v for k, v in os.environ.items() if not k.startswith("DPU_AGENT_")},
    )
    assert proc.returncode == 2
    assert "configuration error: no TLS is configured" in proc.stderr


def test_every_setting_has_a_file_key_and_an_environment_variable():
    fields = {f.name for f in dataclasses.fields(config.AgentConfig)}
    assert {s.attr for s in config.SETTINGS} == fields
    assert len({s.env for s in config.SETTINGS}) == len(config.SETTINGS)


@pytest.mark.parametrize(
    ("env", "attr", "value"),
    [
        ({"DPU_AGENT_TRANSPORTS": "tcp, verbs"}, "transports", "tcp,verbs"),
        ({"DPU_AGENT_POLL_MODE": "BUSY"}, "poll_mode", "busy"),
        ({"DPU_AGENT_QUEUE_DEPTH": "8"}, "queue_depth", 8),
        ({"DPU_AGENT_CHUNK_SIZE": "4096"}, "chunk_size", 4096),
        ({"DPU_AGENT_ORPHAN_TIMEOUT": "1.5"}, "orphan_timeout", 1.5),
    ],
)
def test_dataplane_settings_from_the_environment(env, attr, value):
    assert getattr(config.load(None, environ=env), attr) == value


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"DPU_AGENT_TRANSPORTS": "rdma"}, "comma list of verbs, tcp"),
        ({"DPU_AGENT_QUEUE_DEPTH": "0"}, "from 1 to 1024"),
        ({"DPU_AGENT_CHUNK_SIZE": "100"}, "from 4096"),
        ({"DPU_AGENT_POLL_MODE": "spin"}, "adaptive, busy, event"),
    ],
)
def test_bad_dataplane_settings(env, message):
    with pytest.raises(config.ConfigError, match=message):
        config.load(None, environ=env)


def test_cli_reports_verbs_without_a_device_clearly():
    proc = subprocess.run(
        [sys.executable, "-m", "dpu_agent", "serve", "--listen", "127.0.0.1:0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={
            **os.environ,
            "DPU_AGENT_TRANSPORTS": "verbs",
            "DPU_AGENT_TLS_PLAINTEXT_LOOPBACK": "1",
        },
    )
    assert proc.returncode == 2
    assert "configuration error: dataplane.transports names verbs" in proc.stderr
    assert "Traceback" not in proc.stderr
