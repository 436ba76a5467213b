"""The gRPC messages and service of ``target.proto``, generated when first imported.

The modules are built from the ``.proto`` that ships in the package by grpcio-tools at import time
(``grpc.protos_and_services``), so they always match the protobuf runtime that is installed: no
checked-in ``_pb2`` file can fall out of step with it and break the import.
"""

from __future__ import annotations

import sys
from pathlib import Path

import grpc

_ROOT = str(Path(__file__).resolve().parents[2])  # the folder that holds the omnidraft package
PROTO = "omnidraft/rpc/target.proto"


def _load():
    added = _ROOT not in sys.path
    if added:  # protoc resolves the .proto against sys.path; an editable install may not list the repo
        sys.path.insert(0, _ROOT)
    try:
        return grpc.protos_and_services(PROTO)
    finally:
        if added:
            sys.path.remove(_ROOT)


pb, services = _load()
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Target"].full_name
