"""The one compiled piece: the verbs transport's posts and polls (dpu_wire/transport/_vcore.c).

Everything else is in pyproject.toml. The extension is optional: without a C compiler or
the verbs headers (Debian's libibverbs-dev) the package installs without it, and the
verbs transport runs its pure-Python path (dpu_wire/transport/native.py says which).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "dpu_wire.transport._vcore",
            ["dpu_wire/transport/_vcore.c"],
            extra_compile_args=[
                "-O2",
                "-std=gnu11",
                "-Wall",
                "-Wextra",
                "-Wno-unused-parameter",  # METH_NOARGS functions take an unused argument
                "-Werror=implicit",
            ],
            optional=True,
        )
    ]
)
