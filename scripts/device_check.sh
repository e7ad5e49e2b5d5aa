#!/usr/bin/env bash
# The accelerator check of issue 14 §4 (logic in scripts/device_check.py; its docstring says
# what each part measures). Prints one JSON line last; logs and device_check.json go to
# --out, else $OUT. Installs nothing from the network.
#
#   bash scripts/device_check.sh            # one NVIDIA GPU, under 8 minutes
#   bash scripts/device_check.sh --cpu      # JAX on CPU, tiny shapes (the test suite's form)
#   bash scripts/device_check.sh --tpu --only programs --config=configs/tpu/lora_v5e8.py
#                                           # on a TPU VM: the programs compile_check compiled
#
# Wheels the GPU image lacks travel in .whl/ (ignored by git): where pip works, once,
#   echo /.whl/ >> .git/info/exclude; bash scripts/device_check.sh --download-wheels
# then on the device (run tool, carry [".whl"]): bash scripts/device_check.sh
# Only the carried wheels of requirements the image misses or holds out of range are installed.
set -u
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
exec "$PY" scripts/device_check.py "$@"
