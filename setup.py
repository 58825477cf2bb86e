"""The C copy kernel (the rest of the build is in pyproject.toml).

Here rather than in ``[tool.setuptools] ext-modules``, which setuptools
still calls experimental and warns about at every build. Optional: without
a compiler the install goes on, and ``fabric.kv.pack`` falls back to torch
copies.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "fabric.kv._copy",
            sources=["fabric/kv/_copy.c"],
            extra_link_args=["-pthread"],
            optional=True,
        )
    ]
)
