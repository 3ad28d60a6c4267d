#!/usr/bin/env bash
# The prepared GPU check (bench/gpu_check.py): mpedu on this machine's CUDA GPUs in under five
# minutes, one line per step and a JSON summary last. Exit 0: passed; 1: a step failed; 2: no CUDA GPU.
#   bash bench/gpu_check.sh                 # every step
#   bash bench/gpu_check.sh --steps 1,3,4   # some of them
# Uses .venv/bin/python when the repository has one, else $PYTHON, else python3.
set -u
cd "$(dirname "$0")/.." || exit 2
if [ -n "${PYTHON:-}" ]; then py=$PYTHON
elif [ -x .venv/bin/python ]; then py=.venv/bin/python
else py=python3
fi
# plain fp32 in every process it starts (the pytest run and the train runs too): the comparisons with
# the CPU claim fp32 rounding, and cuDNN/cuBLAS would otherwise multiply in TF32
export NVIDIA_TF32_OVERRIDE=0
# the script keeps to its own 290 s budget; this outer limit only catches a hang it cannot report
exec timeout -k 10 320 "$py" bench/gpu_check.py "$@"
