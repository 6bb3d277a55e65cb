#!/usr/bin/env bash
# Checks that need a CUDA device: the GPU-marked tests, then the transfer benchmark on the GPU.
# Run from anywhere on a CUDA host after `make test` (or `make install-dev`) built .venv.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [[ ! -x .venv/bin/python ]]; then
    echo "gpu-check: .venv is missing; run 'make install-dev' (or 'make test') first" >&2
    exit 1
fi

if ! .venv/bin/python -c 'import torch; assert torch.cuda.is_available()'; then
    echo "gpu-check: torch in .venv sees no CUDA device (torch.cuda.is_available() is False);" \
         "run this on a CUDA host with a CUDA build of torch" >&2
    exit 1
fi

echo "==> pytest -m gpu"
.venv/bin/pytest -m gpu -v

echo "==> kvwarden bench transfer --device cuda"
.venv/bin/kvwarden bench transfer --device cuda
