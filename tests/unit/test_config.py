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
        ("[agent]\ngrace_period = -1", "seconds in 0-3600 s"),
        ("[agent]\ngrace_period = true", "seconds in 0-3600 s"),
        ("[agent]\nmax_connections = 0", "integer in 8-1048576"),
        ("[agent]\nhandshake_timeout = 0", "seconds in 0.1-120 s"),
        ("[dataplane]\norphan_timeout = 0", "seconds in 0.5-3600 s"),
        ("[dataplane]\nqueue_depth = 8.0", "integer in 1-1024"),
        ("[mqtt]\ntelemetry_interval = 0.01", "0 = off, or 0.1-3600 s"),
        ("[agent]\ngrace_period = nan", "seconds in 0-3600 s"),
        ("[agent]\ngrace_period = inf", "seconds in 0-3600 s"),
        ("a = " + "[" * 5000 + "]" * 5000, "nested too deeply"),
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
        ({"DPU_AGENT_REACTOR_CPUS": ""}, "reactor_cpus", ""),
    ],
)
def test_dataplane_settings_from_the_environment(env, attr, value):
    assert getattr(config.load(None, environ=env), attr) == value


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"DPU_AGENT_TRANSPORTS": "rdma"}, "comma list of verbs, tcp"),
        ({"DPU_AGENT_QUEUE_DEPTH": "0"}, "in 1-1024"),
        ({"DPU_AGENT_CHUNK_SIZE": "100"}, "in 4096-16777216"),
        ({"DPU_AGENT_POLL_MODE": "spin"}, "adaptive, busy, event"),
        ({"DPU_AGENT_REACTOR_CPUS": "a"}, "not a CPU number"),
        ({"DPU_AGENT_REACTOR_CPUS": "3-1"}, "not a range within 0-4095"),
        ({"DPU_AGENT_REACTOR_CPUS": "1-99999"}, "not a range within 0-4095"),
        ({"DPU_AGENT_REACTOR_CPUS": "0--1"}, "not a CPU number or a range"),
        ({"DPU_AGENT_REACTOR_CPUS": "4095"}, "CPU 4095 is not one this process may run on"),
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


def numeric_settings():
    return [s for s in config.SETTINGS if isinstance(s.parse, config.Number)]


def test_every_numeric_setting_has_bounds_and_its_default_is_inside_them():
    defaults = config.AgentConfig()
    numeric = {
        f.name
        for f in dataclasses.fields(config.AgentConfig)
        if isinstance(getattr(defaults, f.name), int | float)
        and not isinstance(getattr(defaults, f.name), bool)
    }
    assert {s.attr for s in numeric_settings()} == numeric
    for setting in numeric_settings():
        bounds = setting.parse
        assert bounds.low <= bounds.high, setting.key
        default = getattr(defaults, setting.attr)
        assert bounds(default, "default") == default, setting.key


@pytest.mark.parametrize("setting", numeric_settings(), ids=lambda s: f"{s.section}.{s.key}")
def test_every_numeric_setting_refuses_values_outside_its_bounds(setting):
    bounds = setting.parse
    below = bounds.low - (0.25 if bounds.seconds else 1)
    if bounds.off and below == 0:  # 0 is allowed there: it means off / no limit
        below = bounds.low / 2 if bounds.seconds else None
    outside = [str(bounds.high + 1), "-1", "x", ""]
    if below is not None and not (bounds.off and below == 0):
        outside.append(str(below))
    for text in outside:
        with pytest.raises(config.ConfigError, match=rf"\${setting.env}: .*{bounds.text}"):
            config.load(None, environ={setting.env: text})
    assert config.load(None, environ={setting.env: str(bounds.high)})


def test_unicode_digits_are_a_config_error_not_a_crash():
    with pytest.raises(config.ConfigError, match="QUEUE_DEPTH"):
        config.load(None, environ={"DPU_AGENT_QUEUE_DEPTH": "\u00b2"})  # "2" superscript


def run_cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "dpu_agent", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("DPU_AGENT_")},
            **(env or {}),
        },
    )


@pytest.mark.parametrize("command", ["check-config", "serve"])
@pytest.mark.parametrize(
    ("text", "env", "fragment"),
    [
        ("[dataplane]\norphan_timeout = 0\n", {}, "dataplane.orphan_timeout: expected"),
        ("", {"DPU_AGENT_ORPHAN_TIMEOUT": "0"}, "$DPU_AGENT_ORPHAN_TIMEOUT: expected"),
        ("a = " + "[" * 3000 + "]" * 3000 + "\n", {}, "nested too deeply"),
        ("x = {" * 3000 + "\n", {}, "invalid TOML"),
        ('[agent]\n"bad\\nkey" = 1\n', {}, "unknown setting agent.bad\\nkey"),
    ],
)
def test_a_bad_setting_or_file_is_one_line_on_stderr_and_exit_2(
    tmp_path, command, text, env, fragment
):
    path = write(tmp_path, text + "[tls]\nplaintext_loopback = true\n")
    proc = run_cli(command, "--config", str(path), env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert proc.stderr.startswith("dpu-agent: configuration error: ")
    assert fragment in proc.stderr


def test_reactor_cpus_are_normalised_and_checked_against_this_process():
    allowed = sorted(os.sched_getaffinity(0))
    text = ",".join(str(cpu) for cpu in reversed(allowed))
    cfg = config.load(None, environ={"DPU_AGENT_REACTOR_CPUS": text + "," + text})
    assert config.parse_cpus(cfg.reactor_cpus) == frozenset(allowed)
    assert config.parse_cpus("0-2,5, 7-7") == {0, 1, 2, 5, 7}
    assert config.parse_cpus("") == frozenset()
