"""An undo stack for multi-step changes: each done step pushes how to take it back."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Self

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import TracebackType

log = logging.getLogger(__name__)


class Undo:
    """Context manager: on an exception, run the pushed undo steps newest first, then re-raise.

    A failing undo step is logged and the next one still runs; the original error is
    the one raised. `commit()` keeps everything (nothing is undone at exit).
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self._steps: list[tuple[str, Callable[[], object]]] = []

    def push(self, description: str, step: Callable[[], object]) -> None:
        """Remember how to take back what was just done."""
        self._steps.append((description, step))

    def commit(self) -> None:
        """Keep the changes."""
        self._steps.clear()

    def rollback(self) -> None:
        """Take every step back, newest first."""
        while self._steps:
            description, step = self._steps.pop()
            try:
                step()
            except Exception as exc:  # noqa: BLE001 - keep undoing; the caller raises the cause
                log.warning(
                    "undo step failed",
                    extra={"change": self.what, "step": description, "error": str(exc)},
                )

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None:
            self.rollback()
        self.commit()
