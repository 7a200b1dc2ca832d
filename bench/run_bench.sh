#!/usr/bin/env bash
# Reproduce the benchmark table: graphmode vs eager PyTorch, torch.compile, ONNX Runtime and
# OpenVINO (reported "not installed" when absent) on all-MiniLM-L6-v2, GPT-2 small and
# ResNet-18 at their standard shapes, 2 threads. Results land in bench/results/.
#   bench/run_bench.sh                      # the full table (several minutes: torch.compile is slow)
#   bench/run_bench.sh --quick              # one shape per model, 3 rounds, exits 1 on a failure/mismatch
#   bench/run_bench.sh --model minilm --shape 1x128 --with freezing
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
export HF_HUB_OFFLINE=1
exec python -m graphmode bench --threads "${THREADS:-2}" "$@"
