"""An agent with one extra slow RPC, `/test.Slow/Sleep`, to test graceful shutdown.

The request payload is the number of seconds to sleep, as ASCII; the reply is b"done".
Run as: python slow_agent.py --listen HOST:PORT --ready-file PATH
"""

import argparse
import asyncio
from pathlib import Path

import grpc

from dpu_agent import config, logs, server


async def sleep(request: bytes, _context: object) -> bytes:
    await asyncio.sleep(float(request.decode()))
    return b"done"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("serve")
    parser.add_argument("--listen", required=True)
    parser.add_argument("--ready-file", type=Path, required=True)
    parser.add_argument("--log-format", default="json")
    args = parser.parse_args()
    cfg = config.load(None, overrides={"listen": args.listen, "log_format": args.log_format})
    logs.configure(cfg.log_level, cfg.log_format)
    handler = grpc.method_handlers_generic_handler(
        "test.Slow", {"Sleep": grpc.unary_unary_rpc_method_handler(sleep)}
    )
    asyncio.run(server.serve(cfg, ready_file=args.ready_file, extra_handlers=[handler]))


if __name__ == "__main__":
    main()
