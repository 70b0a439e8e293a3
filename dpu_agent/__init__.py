"""The DPU-side agent: a gRPC server offloading storage, network and virtualization work.

Run it with the `dpu-agent` command; embed it with `dpu_agent.server.AgentServer`.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("dpu-offload")
except PackageNotFoundError:  # pragma: no cover - running from a bare checkout
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
