"""Generate `elastic/v1/*_pb2*.py` from `proto/elastic/v1/*.proto`.

Run `python -m elastic.protogen` after editing a .proto file (needs the `dev`
extra for grpcio-tools). `tests/test_protocol.py` fails when the committed
generated code differs from what this produces.
"""

from __future__ import annotations

import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "proto"


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Compile every .proto under proto/ into `out_dir` (a package root).

    Returns the generated files. Raises RuntimeError when protoc fails.
    """
    from grpc_tools import protoc
    import grpc_tools

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *protos]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {protos}")
    outputs = []
    for proto in protos:
        stem = out_dir / proto[: -len(".proto")]
        outputs += [stem.with_name(stem.name + suffix)
                    for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]
    return outputs


def main() -> int:
    generated = generate(REPO)
    for path in generated:
        print(path.relative_to(REPO))
    return 0


if __name__ == "__main__":
    sys.exit(main())
