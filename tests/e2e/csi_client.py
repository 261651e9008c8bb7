"""The CSI client of the harness: proto/csi.proto compiled with grpcio-tools at import time
(into the work dir), channels to a unix socket."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import grpc
from grpc_tools import protoc

from kube import W

REPO = Path(__file__).resolve().parent.parent.parent
_OUT = W / "py-csi"
_OUT.mkdir(parents=True, exist_ok=True)
_include = str(Path(protoc.__file__).parent / "_proto")
if protoc.main(["protoc", f"-I{REPO / 'proto'}", f"-I{_include}", f"--python_out={_OUT}",
                f"--grpc_python_out={_OUT}", str(REPO / "proto" / "csi.proto")]) != 0:
    raise RuntimeError("cannot compile proto/csi.proto")
sys.path.insert(0, str(_OUT))
pb = importlib.import_module("csi_pb2")
rpc = importlib.import_module("csi_pb2_grpc")


def channel(socket: Path) -> grpc.Channel:
    return grpc.insecure_channel(f"unix://{socket}")


def controller(socket: Path):
    return rpc.ControllerStub(channel(socket))


def node(socket: Path):
    return rpc.NodeStub(channel(socket))


def identity(socket: Path):
    return rpc.IdentityStub(channel(socket))
