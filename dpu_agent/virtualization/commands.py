"""Running the system's tools (ip, tc, devlink, ...) for the function backends.

Creating a function is rare and each step is one well-known command, so the backends
drive the reference tools rather than re-implementing their netlink messages; every
command is logged at debug level, and a failing one becomes a domain error carrying
the tool's own message. `Runner` is the seam unit tests replace with recorded output.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from typing import TYPE_CHECKING, Protocol

from dpu_agent.errors import FailedPrecondition, Unavailable

if TYPE_CHECKING:
    from collections.abc import Sequence

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 30.0


class CommandFailed(FailedPrecondition):
    """A tool answered with a non-zero exit status; the message has its stderr."""

    def __init__(self, argv: Sequence[str], code: int, stderr: str) -> None:
        self.argv = tuple(argv)
        self.code = code
        self.stderr = stderr.strip()
        super().__init__(f"{' '.join(argv[:3])}: {self.stderr or f'exit status {code}'}")


class Runner(Protocol):
    """Runs one command and returns its standard output."""

    def __call__(self, argv: Sequence[str], *, input_text: str | None = None) -> str:
        """Stdout of `argv`; CommandFailed on a non-zero exit, Unavailable if it cannot run."""
        ...


class SubprocessRunner:
    """The real thing: `subprocess.run` without a shell, with a timeout."""

    def __init__(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.timeout = timeout

    def __call__(self, argv: Sequence[str], *, input_text: str | None = None) -> str:
        """Stdout of `argv`; CommandFailed on a non-zero exit, Unavailable if it cannot run."""
        if shutil.which(argv[0]) is None:
            raise Unavailable(f"{argv[0]}: not installed (needed by the function backend)")
        log.debug("run", extra={"argv": list(argv)})
        try:
            done = subprocess.run(  # noqa: S603 - argv list, no shell
                list(argv),
                input=input_text,
                capture_output=True,
                text=True,
                timeout=self.timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise Unavailable(f"{argv[0]}: no answer within {self.timeout:g} s") from None
        except OSError as exc:
            raise Unavailable(f"{argv[0]}: {exc.strerror}") from None
        if done.returncode != 0:
            raise CommandFailed(argv, done.returncode, done.stderr)
        return done.stdout
