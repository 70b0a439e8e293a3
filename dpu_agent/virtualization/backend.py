"""The small interface a function backend implements.

Synchronous and thread-safe; the service calls the manager, and so the backend, in a
thread (`dpu_agent.offload.in_thread`). Every
method raises domain errors only (`dpu_agent.errors`). `create` is all or nothing:
when any step fails, the steps before it are undone before the error is raised, so
nothing half-made remains in the kernel or the hardware.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dpu_agent.virtualization.model import FunctionSpec, Provisioned


class FunctionBackend(abc.ABC):
    """Makes, changes and removes the devices behind functions."""

    name: str = "backend"

    @abc.abstractmethod
    def create(self, spec: FunctionSpec) -> Provisioned:
        """Make the function, all of it or nothing."""

    @abc.abstractmethod
    def update(self, old: FunctionSpec, new: FunctionSpec, made: Provisioned) -> Provisioned:
        """Apply the changed mutable fields (mac, mtu, vlan, rate limit, trust, spoof check)."""

    @abc.abstractmethod
    def delete(self, spec: FunctionSpec, made: Provisioned) -> None:
        """Remove everything `create` made; no error if it is already gone.

        After a crash in the middle of `create`, the manager calls this with an empty
        `Provisioned("", "")`: the backend then finds what it left by the function id
        (names, markers or tags derived from it), so nothing half-made survives.
        """

    def busy(self, spec: FunctionSpec, made: Provisioned) -> str | None:
        """Why the function cannot be deleted now (e.g. its block device is mounted), or None."""
        return None

    def present(self, spec: FunctionSpec, made: Provisioned) -> bool:
        """Whether the function's devices still exist (checked when the agent restarts)."""
        return True

    def restore(self, spec: FunctionSpec, made: Provisioned) -> Provisioned:
        """Bring back what does not survive an agent restart (e.g. a block export)."""
        return made

    def close(self) -> None:  # noqa: B027 - optional
        """Release the backend's resources (exports served by this process end here)."""
