"""The verbs transport's native core (setup.py's optional C extension) is built here.

The extension is optional so that the package installs anywhere, but where its build inputs
are present (the compiler Python builds extensions with, <Python.h> from python3-dev,
<infiniband/verbs.h> from libibverbs-dev) it must have been built: a compile error must
not pass for "no compiler here". `make venv` builds it in place; deploy/aarch64 builds the
arm64 one in its root; the container image builds its own in a build stage.
"""

import shutil
import sysconfig
from pathlib import Path

import pytest

from dpu_wire.transport import native

VERBS_H = Path("/usr/include/infiniband/verbs.h")


def missing_inputs() -> list[str]:
    """What this machine lacks to compile dpu_wire/transport/_vcore.c, in words."""
    missing = []
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        missing.append(f"the C compiler {cc} (gcc)")
    python_h = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not python_h.exists():
        missing.append(f"{python_h} (python3-dev)")
    if not VERBS_H.exists():
        missing.append(f"{VERBS_H} (libibverbs-dev)")
    return missing


def test_native_core_is_built_where_its_inputs_are():
    missing = missing_inputs()
    if missing:
        pytest.skip(
            f"the native core cannot be built here, no {', '.join(missing)}: the verbs "
            "transport runs its pure-Python path (deploy/apt-packages.txt lists them)"
        )
    try:
        from dpu_wire.transport import _vcore  # noqa: PLC0415 - the point of the test
    except ImportError as exc:
        error = str(exc)
    else:
        assert _vcore.ABI == native.ABI  # a stale build would not be used
        return
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    pytest.fail(
        f"the build inputs are here but dpu_wire.transport._vcore does not import ({error}): "
        f"dpu_wire/transport/_vcore{suffix} was not built or does not load. `make venv` "
        "(deploy/aarch64/run-tests.sh in its arm64 root) builds it and shows the compiler's "
        "errors",
        pytrace=False,
    )
