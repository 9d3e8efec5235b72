#!/usr/bin/env bash
# Regenerates the gRPC stubs from api/proto/dsec.proto (needs grpcio-tools). The generated
# files are committed so that `pip install ./sdk/python` needs no code generator.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
python3 -m grpc_tools.protoc -I ../../api/proto --python_out=dsec --pyi_out=dsec \
    --grpc_python_out=dsec ../../api/proto/dsec.proto
# protoc emits absolute imports; the stubs live inside the package.
sed -i 's/^import dsec_pb2 as dsec__pb2/from . import dsec_pb2 as dsec__pb2/' dsec/dsec_pb2_grpc.py
