#!/usr/bin/env bash
# Regenerates the gRPC stubs from api/proto/dsec.proto and the common.proto it imports (needs
# grpcio-tools). The generated files are committed so that `pip install ./sdk/python` needs
# no code generator.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
python3 -m grpc_tools.protoc -I ../../api/proto --python_out=dsec --pyi_out=dsec \
    --grpc_python_out=dsec ../../api/proto/dsec.proto ../../api/proto/common.proto
# common.proto has no services.
rm -f dsec/common_pb2_grpc.py
# protoc emits absolute imports; the stubs live inside the package.
sed -i -E 's/^import (dsec|common)_pb2 as /from . import \1_pb2 as /; s/^from common_pb2 import /from .common_pb2 import /' \
    dsec/dsec_pb2.py dsec/dsec_pb2.pyi dsec/dsec_pb2_grpc.py dsec/common_pb2.pyi
