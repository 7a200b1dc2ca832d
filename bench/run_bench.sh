#!/usr/bin/env bash
# Reproduce the benchmark table: graphmode vs eager PyTorch, torch.compile (default and
# max-autotune), ONNX Runtime and OpenVINO (reported "not installed" when absent) on
# all-MiniLM-L6-v2, GPT-2 small and ResNet-18 at their standard shapes, 2 threads. Results land
# in bench/results/.
#   bench/run_bench.sh                      # the full table (several minutes: torch.compile is slow)
#   bench/run_bench.sh --quick              # one shape per model, 3 rounds, exits 1 on a failure/mismatch
#   bench/run_bench.sh --model minilm --shape 1x128 --with freezing
#   bench/run_bench.sh --isa avx2 --name bench-avx2   # an AVX2 host's table, as far as one host can show it
# With --isa, torch's and oneDNN's kernels are held to the same ISA (they read these variables
# once, at process start); MLAS (ONNX Runtime, OpenVINO's matmuls) has no such switch.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
export HF_HUB_OFFLINE=1
isa=""
prev=""
for a in "$@"; do
  case "$a" in --isa=*) isa="${a#--isa=}" ;; esac
  if [ "$prev" = "--isa" ]; then isa="$a"; fi
  prev="$a"
done
if [ -n "$isa" ]; then     # graphmode.bench.machine.ISA_ENV holds the values; a variable already set wins
  eval "$(python -c 'import sys
from graphmode.bench.machine import ISA_ENV
for k, v in ISA_ENV.get(sys.argv[1], {}).items():
    print(f"export {k}=${{{k}:-{v}}}")' "$isa")"
fi
exec python -m graphmode bench --threads "${THREADS:-2}" "$@"
