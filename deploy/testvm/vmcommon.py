"""The test VM harness's common parts: paths, errors, progress lines, host tools."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

PROG = "testvm"
EXIT_HARNESS = 125
EXIT_INTERRUPTED = 130
CHECKOUT = Path(__file__).resolve().parents[2]
OUT_DIR = CHECKOUT / ".testvm" / "out"
CONSOLE_TAIL_LINES = 30


class HarnessError(Exception):
    """The harness failed (as opposed to the command it runs)."""


def say(msg: str) -> None:
    """Print a progress line of the harness on stderr."""
    print(f"{PROG}: {msg}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    """Return the cache directory: $DPU_TESTVM_CACHE, else $XDG_CACHE_HOME or ~/.cache."""
    explicit = os.environ.get("DPU_TESTVM_CACHE")
    if explicit:
        return Path(explicit).expanduser().resolve()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return (Path(base).expanduser() / "dpu-testvm").resolve()


def need_tool(name: str, package: str) -> str:
    """Return the path of a host tool or fail naming the Debian package that has it."""
    for candidate in (shutil.which(name), f"/usr/sbin/{name}", f"/sbin/{name}"):
        if candidate and Path(candidate).is_file():
            return candidate
    raise HarnessError(
        f"'{name}' not found: apt-get install {package} (see deploy/testvm/apt-packages.txt)"
    )


def run_tool(argv: Sequence[str], what: str, cwd: Path | None = None) -> str:
    """Run a host tool, returning its stdout; raise HarnessError with its stderr on failure."""
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise HarnessError(f"{what} failed ({shlex.join(argv)}): {' / '.join(detail)}")
    return proc.stdout


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock file while fetching, so parallel runs do not race."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def harness_failure(reason: str, console: Sequence[str]) -> int:
    """Report a failure of the harness (one line, then the console tail) and return 125."""
    print(f"{PROG}: error: {reason}", file=sys.stderr)
    if console:
        print(f"{PROG}: last console lines:", file=sys.stderr)
        for line in console:
            print(f"    {line}", file=sys.stderr)
    sys.stderr.flush()
    return EXIT_HARNESS
