"""`dpu-agent`: run the DPU agent."""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import sys
from pathlib import Path

from dpu_agent import __version__, config, core_log, logs, server, tls
from dpu_agent.network import tags


def _parser() -> argparse.ArgumentParser:
    env_help = "\n".join(
        f"  {s.env:<37} {s.section}.{s.key}: {s.help}"
        + (f" ({s.parse.text})" if isinstance(s.parse, config.Number) else "")
        for s in config.SETTINGS
    )
    parser = argparse.ArgumentParser(
        prog="dpu-agent",
        description="The DPU offload agent: serves the dpu.v1 gRPC API.",
    )
    parser.add_argument("--version", action="version", version=f"dpu-agent {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser(
        "serve",
        help="run the agent until SIGTERM/SIGINT",
        description="Run the agent until SIGTERM or SIGINT, then drain in-flight RPCs.",
        epilog="settings come from defaults < --config file < environment < flags.\n"
        "environment variables:\n" + env_help,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument("-c", "--config", type=Path, help="TOML configuration file")
    serve.add_argument("--listen", help="gRPC listen address host:port (port 0: any free port)")
    serve.add_argument("--agent-id", help="agent id (its resource name is agents/{id})")
    serve.add_argument("--log-level", choices=logs.LEVELS)
    serve.add_argument("--log-format", choices=logs.FORMATS)
    serve.add_argument(
        "--plaintext-loopback",
        action="store_const",
        const=True,
        help="serve without TLS (only on a loopback address; = [tls] plaintext_loopback)",
    )
    serve.add_argument(
        "--ready-file",
        type=Path,
        help="write the bound host:port here once serving (for scripts)",
    )
    check = sub.add_parser(
        "check-config",
        help="validate a configuration and print the merged result",
        description="Validate the configuration (file + environment) and print it, "
        "including the TLS files, tokens file and tenant tags file the agent would read; "
        "exit 2 if the agent would refuse to start (e.g. a non-loopback address without TLS).",
    )
    check.add_argument("-c", "--config", type=Path, help="TOML configuration file")
    return parser


def _error(message: str) -> None:
    """One line on stderr, whatever the message holds."""
    print(f"dpu-agent: {logs.printable(message)}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `dpu-agent`."""
    faulthandler.enable()  # a crash in native code (pyverbs, libibverbs) prints every thread
    args = _parser().parse_args(argv)
    overrides = {}
    if args.command == "serve":
        overrides = {
            "listen": args.listen,
            "agent_id": args.agent_id,
            "log_level": args.log_level,
            "log_format": args.log_format,
            "tls_plaintext_loopback": args.plaintext_loopback,
        }
    try:
        cfg = config.load(args.config, overrides=overrides)
    except config.ConfigError as exc:
        _error(f"configuration error: {exc}")
        return 2
    if args.command == "check-config":
        for field, value in vars(cfg).items():
            print(f"{field} = {value!r}")
        try:
            security = tls.security(cfg)
            granted = tags.from_config(cfg)
        except config.ConfigError as exc:
            _error(f"configuration error: {exc}")
            return 2
        print(f"# security: {security.description}")
        untagged = sum(grant.untagged for grant in granted.grants.values())
        print(
            f"# tenant tags: {len(granted.grants)} tenant(s) granted VLAN ids or VNIs;"
            f" {untagged} may send untagged to an uplink"
        )
        return 0
    core_log.capture()  # gRPC core's lines (failed TLS handshakes) become our records
    faulthandler.enable(file=sys.stderr)  # the real stderr, not the capture pipe
    logs.configure(cfg.log_level, cfg.log_format, access_per_s=cfg.log_access_per_s)
    try:
        asyncio.run(server.serve(cfg, ready_file=args.ready_file))
    except config.ConfigError as exc:
        _error(f"configuration error: {exc}")
        return 2
    except OSError as exc:
        logging.getLogger("dpu_agent").error("cannot start: %s", exc)  # noqa: TRY400
        _error(str(exc))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
