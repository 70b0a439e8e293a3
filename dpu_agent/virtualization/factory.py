"""The function manager the configuration asks for (None when virtualization is off)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from dpu_agent.config import ConfigError, functions_file
from dpu_agent.quota import Quotas
from dpu_agent.virtualization.bluefield import BlueFieldFunctionBackend
from dpu_agent.virtualization.linux_backend import LinuxFunctionBackend, LinuxSettings
from dpu_agent.virtualization.manager import FunctionManager
from dpu_agent.virtualization.memory_backend import MemoryFunctionBackend
from dpu_agent.virtualization.store import FunctionStore

if TYPE_CHECKING:
    from collections.abc import Callable

    from dpu_agent.config import AgentConfig
    from dpu_agent.network.model import FlowRule
    from dpu_agent.storage.backend import VolumeStore
    from dpu_agent.storage.exports import VolumeExports
    from dpu_agent.virtualization.backend import FunctionBackend

log = logging.getLogger(__name__)


def make_backend(config: AgentConfig, volumes: VolumeStore | None) -> FunctionBackend:
    """The backend named by `[virtualization] backend`."""
    if config.virt_backend == "memory":
        return MemoryFunctionBackend()
    if config.virt_backend == "linux":
        return LinuxFunctionBackend(
            LinuxSettings(
                dpu_netns=config.network_netns,
                host_netns_prefix=config.virt_host_netns_prefix,
                block_export=config.virt_block_export,
                nvmf_address=config.virt_nvmf_address,
                nvmf_port=config.virt_nvmf_port,
                nvmf_host_address=config.virt_nvmf_host_address,
            ),
            volumes=volumes,
        )
    if config.virt_backend == "bluefield":
        return BlueFieldFunctionBackend()
    raise ConfigError(f"virtualization.backend: unknown backend {config.virt_backend!r}")


def open_functions(
    config: AgentConfig,
    *,
    volumes: VolumeStore | None,
    exports: VolumeExports,
    flow_rules: Callable[[], list[FlowRule]],
) -> FunctionManager | None:
    """Start the function manager (recovering saved functions), or None when it is off."""
    if config.virt_backend == "none":
        return None
    manager = FunctionManager(
        make_backend(config, volumes),
        FunctionStore(functions_file(config)),
        volumes=volumes,
        exports=exports,
        flow_rules=flow_rules,
        quotas=Quotas.from_config(config),
    )
    report = manager.start()
    log.info(
        "functions recovered",
        extra={
            "backend": config.virt_backend,
            "kept": len(report.kept),
            "restored": len(report.restored),
            "cleaned": len(report.cleaned),
            "failed": len(report.failed),
        },
    )
    return manager
