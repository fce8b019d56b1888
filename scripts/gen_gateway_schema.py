"""Regenerate pylon/gateway/stargate_pb2*.py(i) from pylon/gateway/stargate.proto.

`--check`: regenerate into a scratch directory and fail (exit 1) when the committed modules differ,
so the .proto stays the one source of the gateway contract. Needs grpcio-tools and mypy-protobuf
(the dev extra).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = Path("pylon/gateway/stargate.proto")
OUTPUTS = ("stargate_pb2.py", "stargate_pb2.pyi", "stargate_pb2_grpc.py", "stargate_pb2_grpc.pyi")


def generate(into: Path) -> None:
    """protoc (grpc_tools) with the python, grpc and mypy plugins, paths relative to the root."""
    plugin_dir = Path(sys.executable).parent
    args = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{ROOT}",
        f"--python_out={into}",
        f"--grpc_python_out={into}",
        f"--plugin=protoc-gen-mypy={plugin_dir / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={plugin_dir / 'protoc-gen-mypy_grpc'}",
        f"--mypy_out={into}",
        f"--mypy_grpc_out={into}",
        str(ROOT / PROTO),
    ]
    subprocess.run(args, check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true")
    check = parser.parse_args().check
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch)
        generate(out)
        stale = []
        for name in OUTPUTS:
            fresh = out / PROTO.parent / name
            committed = ROOT / PROTO.parent / name
            if check:
                if not committed.exists() or committed.read_bytes() != fresh.read_bytes():
                    stale.append(str(committed.relative_to(ROOT)))
            else:
                shutil.copyfile(fresh, committed)
        if stale:
            print("stale, run scripts/gen_gateway_schema.py: " + ", ".join(stale))
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
