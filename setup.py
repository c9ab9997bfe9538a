"""Builds the gRPC stubs from protos/ whenever setuptools builds the package.

`pip install -e .`, `pip install .` and `python -m build` all run `build_py`, which first runs
grpcio-tools' protoc over protos/jaxserve/v1/*.proto. The stubs land in jaxserve/v1/ (the proto
package `jaxserve.v1` is the Python package `jaxserve.v1`), which git ignores: they are never
edited by hand and never committed. Everything else about the package is in pyproject.toml.
"""

from __future__ import annotations

import glob
import os

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))
PROTO_ROOT = os.path.join(ROOT, "protos")
STUB_PACKAGE = "jaxserve.v1"


def generate_stubs() -> list[str]:
    """Runs protoc on every proto under protos/; returns the files it wrote."""
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(glob.glob(os.path.join(PROTO_ROOT, "jaxserve", "v1", "*.proto")))
    if not protos:
        raise RuntimeError(f"no .proto files under {PROTO_ROOT}/jaxserve/v1; the checkout is incomplete")
    out_dir = os.path.join(ROOT, *STUB_PACKAGE.split("."))
    os.makedirs(out_dir, exist_ok=True)
    well_known = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{well_known}", f"--python_out={ROOT}", f"--pyi_out={ROOT}",
            f"--grpc_python_out={ROOT}", *protos]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {protos}")
    init = os.path.join(out_dir, "__init__.py")
    with open(init, "w") as f:
        f.write('"""Stubs generated from protos/jaxserve/v1 by setup.py at build time. Do not edit."""\n')
    return [init, *glob.glob(os.path.join(out_dir, "*_pb2*.py*"))]


class BuildPyWithStubs(build_py):
    """build_py that generates the gRPC stubs first and ships them as the package jaxserve.v1."""

    def run(self) -> None:
        generate_stubs()
        if self.packages is not None and STUB_PACKAGE not in self.packages:
            self.packages.append(STUB_PACKAGE)
        super().run()


setup(cmdclass={"build_py": BuildPyWithStubs})
