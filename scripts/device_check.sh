#!/usr/bin/env bash
# GPU check: run on a machine with an NVIDIA GPU, in one call. Runs the `gpu` tests and the
# tier benchmark (CUDA-event-timed H2D vs a plain pinned tensor.copy_ in the same run) and
# prints a short table last. Uses whatever torch the machine has; installs only what is missing.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/tiercache-device}"
mkdir -p "$out"
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA'; print('torch', torch.__version__, torch.cuda.get_device_name())" || exit 1
python3 -m pip install --quiet --no-deps -e . >/dev/null 2>&1 || python3 -m pip install --quiet -e . >/dev/null
python3 -m pip install --quiet zarr numcodecs lz4 psutil tqdm xxhash pytest hypothesis >/dev/null 2>&1
python3 -m pytest -q -m gpu tests 2>&1 | tee "$out/gpu_tests.txt" | tail -n 5
python3 scripts/bench_tiers.py --json "$out/bench_tiers.json" 2>&1 | tee "$out/bench_tiers.txt" | tail -n 12
echo "== summary =="
tail -n 1 "$out/gpu_tests.txt"
python3 - "$out/bench_tiers.json" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
for name, ratio in doc.get("ratios", {}).items():
    print(f"{name:<18} tiercache/raw = {ratio:.3f}")
PY
