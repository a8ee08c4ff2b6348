"""The build step pyproject.toml cannot say: the gRPC stubs of ``nlmserve.proto``.

``nlmserve.proto`` is generated from ``proto/nlmserve/v1/lm.proto`` into ``proto/`` itself (the
room is the package, as every room is; the generated files are not committed) by every build:
``pip install .``, ``pip wheel .``, the strict editable install of ``make install`` and the Docker images all
run this one step, with ``grpcio-tools`` and ``mypy-protobuf`` from ``[build-system]``.

The generated modules import each other as ``nlmserve.v1``, the proto package; they are
rewritten to ``nlmserve.proto``, the import root they are installed under. The protobuf
runtime the wheel requires is the one the generating protoc's code needs (grpcio-tools
requires exactly that runtime itself): generated code refuses to import on an older one.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import sys
import tempfile
from pathlib import Path

from setuptools import Command, setup
from setuptools.command.build_py import build_py
from setuptools.command.egg_info import egg_info

ROOT = Path(__file__).resolve().parent
PROTO_ROOT = ROOT / "proto"
PROTO = "nlmserve/v1/lm.proto"
OUT = PROTO_ROOT
INIT = '"""Generated from proto/nlmserve/v1/lm.proto by the package build (setup.py); do not edit."""\n'

# Runtime dependencies (the protobuf floor is added from the build's protoc, see above).
# torch: install the CPU build first (`pip install torch==2.13.0`, see Makefile); this range
# is satisfied by it, so pip adds nothing.
DEPENDENCIES = [
    "torch>=2.1",
    "numpy>=1.24",
    "grpcio>=1.60",
    "grpcio-health-checking>=1.60",
    "grpcio-reflection>=1.60",
    # moses_plugin/bleu.py calls BLEU's private methods (tests/test_bleu.py checks each one):
    # below the next major version, whose changes may move them.
    "sacrebleu>=2.4,<3",
    "prometheus-client>=0.19",
    "tqdm>=4.66",
    "matplotlib>=3.7",
    "numba>=0.59",  # the fused CPU training step (lm/fused.py): a wheel, no compiler needed
]
PROTOBUF_FLOOR = "4.25"


def rewrite_imports(text: str) -> str:
    """``nlmserve.v1`` (the proto package) → ``nlmserve.proto`` (the installed module)."""
    text = re.sub(r"^from nlmserve\.v1 import", "from nlmserve.proto import", text, flags=re.M)
    return text.replace("nlmserve.v1.lm_pb2", "nlmserve.proto.lm_pb2")


def _mypy_grpc_plugin(folder: Path) -> Path:
    """mypy-protobuf's gRPC plugin as an executable running this interpreter, whatever PATH holds."""
    plugin = folder / "protoc-gen-mypy_grpc"
    plugin.write_text(f"#!{sys.executable}\nimport sys\nfrom mypy_protobuf.main import grpc\nsys.exit(grpc())\n")
    plugin.chmod(0o755)
    return plugin


def generate_stubs(out: Path = OUT) -> list[str]:
    """Write lm_pb2{,_grpc}.py{,i}, __init__.py and py.typed into ``out``; returns the names
    of the files whose content changed (unchanged files keep their time stamps)."""
    try:
        from grpc_tools import protoc
    except ImportError as exc:
        raise SystemExit("generating nlmserve.proto needs grpcio-tools and mypy-protobuf "
                         "(the build requirements in pyproject.toml)") from exc
    include = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{include}",
                f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}",
                f"--plugin=protoc-gen-mypy_grpc={_mypy_grpc_plugin(tmp_path)}", f"--mypy_grpc_out={tmp}",
                str(PROTO_ROOT / PROTO)]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {PROTO_ROOT / PROTO}")
        files = {p.name: rewrite_imports(p.read_text()) for p in sorted((tmp_path / PROTO).parent.iterdir())}
    files["__init__.py"] = INIT
    files["py.typed"] = ""
    out.mkdir(parents=True, exist_ok=True)
    changed = []
    for name, text in files.items():
        path = out / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            changed.append(name)
    return changed


def protobuf_requirement() -> str:
    """``protobuf>=X``: X is the runtime grpcio-tools (hence its protoc's code) requires."""
    try:
        requires = importlib.metadata.requires("grpcio-tools") or []
    except importlib.metadata.PackageNotFoundError:
        requires = []
    for req in requires:
        m = re.match(r"protobuf\s*([^;]*)", req)
        if m:
            floor = re.search(r">=\s*([\w.]+)", m.group(1))
            if floor:
                return f"protobuf>={floor.group(1)}"
    return f"protobuf>={PROTOBUF_FLOOR}"


class BuildProto(Command):
    """``setup.py build_proto``: generate nlmserve.proto's modules in ``proto/`` from its lm.proto."""

    description = "generate the nlmserve.proto stubs from proto/nlmserve/v1/lm.proto"
    user_options: list[tuple[str, str | None, str]] = []

    def initialize_options(self) -> None:
        pass

    def finalize_options(self) -> None:
        pass

    def run(self) -> None:
        changed = generate_stubs()
        print(f"nlmserve.proto: {', '.join(changed) if changed else 'up to date'} in {OUT}")


class BuildPy(build_py):
    def run(self) -> None:
        self.run_command("build_proto")
        super().run()

    def find_package_modules(self, package: str, package_dir: str) -> list[tuple[str, str, str]]:
        """The checkout's root is the package ``nlmserve``: this build script, beside its
        ``__init__.py``, is not one of its modules."""
        modules: list[tuple[str, str, str]] = super().find_package_modules(package, package_dir)
        return [m for m in modules if (m[0], m[1]) != ("nlmserve", "setup")]


class EggInfo(egg_info):
    """The file list (SOURCES.txt) walks the package directories, the generated stubs among them."""

    def run(self) -> None:
        self.run_command("build_proto")
        super().run()


if __name__ == "__main__":  # as the build backend runs it; tests import the functions above
    setup(
        install_requires=[*DEPENDENCIES, protobuf_requirement()],
        cmdclass={"build_proto": BuildProto, "build_py": BuildPy, "egg_info": EggInfo},
    )
