"""Regenerate the committed gRPC stubs from ``protos/specserve.proto``.

Usage (from the repository root)::

    python -m protos.generate            # rewrite protos/specserve_pb2*.py in place
    python -m protos.generate --out DIR  # write DIR/protos/specserve_pb2*.py instead

The proto is compiled with the repository root as the include path, so the generated gRPC
module imports ``from protos import specserve_pb2`` and works as a package module (which is
what Ray Serve's ``grpc_servicer_functions`` import path needs). ``tests/protos`` regenerates
into a temporary directory and checks the committed stubs are identical.
"""

from __future__ import annotations

import argparse
import importlib.resources
import logging
import pathlib

from grpc_tools import protoc

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_FILES: tuple[str, ...] = ("protos/specserve.proto",)
GENERATED_FILES: tuple[str, ...] = ("protos/specserve_pb2.py", "protos/specserve_pb2_grpc.py")

logger = logging.getLogger(__name__)


def generate_stubs(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Compile every proto of :data:`PROTO_FILES` into ``out_dir`` (mirroring ``protos/``).

    Returns the generated files (:data:`GENERATED_FILES` under ``out_dir``).
    Raises ``RuntimeError`` when protoc fails.
    """
    out_dir = pathlib.Path(out_dir)
    (out_dir / "protos").mkdir(parents=True, exist_ok=True)
    well_known_protos = importlib.resources.files("grpc_tools") / "_proto"
    for proto in PROTO_FILES:
        args = [
            "grpc_tools.protoc",
            f"-I{REPO_ROOT}",
            f"-I{well_known_protos}",
            f"--python_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(REPO_ROOT / proto),
        ]
        status = protoc.main(args)
        if status != 0:
            raise RuntimeError(f"protoc failed with status {status} on {proto}")
    return [out_dir / name for name in GENERATED_FILES]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=REPO_ROOT, help="output root (default: the repo)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for path in generate_stubs(args.out):
        logger.info("wrote %s", path)


if __name__ == "__main__":
    main()
