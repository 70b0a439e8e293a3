"""An in-memory function backend: for unit tests of the layers above, and dry runs.

It makes nothing; it hands out representor names the way the linux backend does
(`pf0vf<N>` for network functions, `pf0sf<N>` for scalable functions) and can be told
to fail a given step, so the manager's rollback is testable without a kernel.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from dpu_agent.errors import FailedPrecondition
from dpu_agent.virtualization.backend import FunctionBackend
from dpu_agent.virtualization.model import FunctionType, Provisioned

if TYPE_CHECKING:
    from dpu_agent.virtualization.model import FunctionSpec


class MemoryFunctionBackend(FunctionBackend):
    """Functions in a dict."""

    name = "memory"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.functions: dict[str, FunctionSpec] = {}
        self.made: dict[str, Provisioned] = {}
        self.fail_create: str | None = None  # set to make the next create fail with this text
        self.busy_reason: dict[str, str] = {}

    def create(self, spec: FunctionSpec) -> Provisioned:
        """Record the function and name its representor."""
        with self._lock:
            if self.fail_create is not None:
                reason, self.fail_create = self.fail_create, None
                raise FailedPrecondition(reason)
            made = self._made(spec)
            self.functions[spec.function_id] = spec
            self.made[spec.function_id] = made
            return made

    def _made(self, spec: FunctionSpec) -> Provisioned:
        if spec.type.is_block:
            used = {m.host_device for m in self.made.values()}
            index = next(i for i in range(len(used) + 1) if f"/dev/memblk{i}" not in used)
            return Provisioned("", f"/dev/memblk{index}")
        prefix = "pf0sf" if spec.type is FunctionType.SF else "pf0vf"
        used = {m.representor_port for m in self.made.values()}
        index = next(i for i in range(len(used) + 1) if f"{prefix}{i}" not in used)
        return Provisioned(f"{prefix}{index}", f"eth-{spec.function_id}"[:15])

    def update(self, old: FunctionSpec, new: FunctionSpec, made: Provisioned) -> Provisioned:
        """Replace the recorded spec."""
        with self._lock:
            self.functions[new.function_id] = new
            return made

    def delete(self, spec: FunctionSpec, made: Provisioned) -> None:
        """Forget the function."""
        with self._lock:
            self.functions.pop(spec.function_id, None)
            self.made.pop(spec.function_id, None)

    def busy(self, spec: FunctionSpec, made: Provisioned) -> str | None:
        """What the test said."""
        return self.busy_reason.get(spec.function_id)

    def present(self, spec: FunctionSpec, made: Provisioned) -> bool:
        """Whether the function is in the dict."""
        return spec.function_id in self.functions
