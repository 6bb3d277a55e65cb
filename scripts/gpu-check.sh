#!/usr/bin/env bash
# Checks that need a CUDA device: the GPU-marked tests (and the refused CUDA IPC handle), then
# the transfer benchmark on the GPU. Run from anywhere on a CUDA host after `make test` (or
# `make install-dev`) built .venv, or with KVWARDEN_PYTHON naming an interpreter that has the
# project's packages and a CUDA build of torch (run from the checkout: it is put on PYTHONPATH).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

py=${KVWARDEN_PYTHON:-.venv/bin/python}
if [[ -z ${KVWARDEN_PYTHON:-} && ! -x .venv/bin/python ]]; then
    echo "gpu-check: .venv is missing; run 'make install-dev' (or 'make test') first," \
         "or set KVWARDEN_PYTHON" >&2
    exit 1
fi
if ! command -v "$py" > /dev/null; then
    echo "gpu-check: KVWARDEN_PYTHON=$py is not an interpreter on this host" >&2
    exit 1
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! "$py" -c 'import torch; assert torch.cuda.is_available()'; then
    echo "gpu-check: torch under $py sees no CUDA device (torch.cuda.is_available() is False);" \
         "run this on a CUDA host with a CUDA build of torch" >&2
    exit 1
fi

echo "==> pytest -m gpu, and the refused CUDA IPC handle"
"$py" -m pytest -p no:cacheprovider -m gpu -v tests
"$py" -m pytest -p no:cacheprovider -v "tests/dataplane/server/test_bad_fields.py::test_register_bogus_cuda_ipc"

echo "==> kvwarden bench transfer --device cuda"
"$py" -m app.cli bench transfer --device cuda
