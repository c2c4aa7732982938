#!/usr/bin/env bash
# Generates every gRPC module into the current directory: Tandem's own protos (protos/), and the
# vLLM engine protocol (package vllm.grpc.engine) from the .proto files of the installed, pinned
# smg-grpc-proto package, its source of truth. Those import "common.proto" from their own folder;
# staged under vllm_engine/ the import names that folder, so the modules land in one package.
# Usage: protos/generate.sh [PYTHON]  (the Makefile and deploy/Dockerfile both run it)
set -euo pipefail
py="${1:-python}"
rm -rf tandem/v1 fmaas vllm_engine
"$py" -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $(find protos -name '*.proto')
src="$("$py" -c 'import os, smg_grpc_proto; print(os.path.join(os.path.dirname(smg_grpc_proto.__file__), "proto"))')"
stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/vllm_engine"
cp "$src/common.proto" "$stage/vllm_engine/common.proto"
sed 's#^import "common.proto";#import "vllm_engine/common.proto";#' "$src/vllm_engine.proto" \
  > "$stage/vllm_engine/vllm_engine.proto"
grep -q '^import "vllm_engine/common.proto";' "$stage/vllm_engine/vllm_engine.proto"
"$py" -m grpc_tools.protoc -I"$stage" --python_out=. --pyi_out=. --grpc_python_out=. \
  "$stage/vllm_engine/common.proto" "$stage/vllm_engine/vllm_engine.proto"
