#!/usr/bin/env bash
# GPU check: run on a machine with an NVIDIA GPU, in one call. Runs the `gpu` tests and the
# tier benchmark (CUDA-event-timed H2D vs a plain pinned tensor.copy_ in the same run) and
# prints a short table last. Uses whatever torch (and cupy) the machine has; installs the rest
# from pyproject.toml, so the set is the one a CPU install gets (tests/test_dependencies.py).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/tiercache-device}"
mkdir -p "$out"
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA'; print('torch', torch.__version__, torch.cuda.get_device_name())" || exit 1
# The package with its `test` extra; torch is in no hard dependency (only the `cpu` extra,
# not installed here), so pip leaves the machine's torch alone. The machine's setuptools
# builds the editable install (no index needed for it); wheels carried in .whl/ are used on a
# machine without an index.
pip_args=(--quiet --no-build-isolation)
[ -d .whl ] && pip_args+=(--find-links .whl)
if ! python3 -m pip install "${pip_args[@]}" -e ".[test]" >"$out/pip.txt" 2>&1; then
    echo "pip install -e '.[test]' failed (full log: $out/pip.txt):"; tail -n 5 "$out/pip.txt"; exit 1
fi
# The `gpu` extra only where the machine has no cupy of its own: a cupy built for another
# CUDA would shadow it. Nothing imports cupy until cuda_ext's kernels land.
if ! python3 -c "import cupy" >/dev/null 2>&1; then
    python3 -m pip install "${pip_args[@]}" -e ".[gpu]" >>"$out/pip.txt" 2>&1 \
        || echo "note: the gpu extra (cupy) did not install; nothing imports cupy yet"
fi
# transformers for the drop-in cache's gpu test (skipped, not failed, where it cannot install)
python3 -m pip install "${pip_args[@]}" -e ".[hf]" >>"$out/pip.txt" 2>&1 \
    || echo "note: the hf extra (transformers) did not install; the transformers cache's gpu test skips"
python3 -m pytest -q -m gpu tests 2>&1 | tee "$out/gpu_tests.txt" | tail -n 5
python3 scripts/bench_tiers.py --json "$out/bench_tiers.json" 2>&1 | tee "$out/bench_tiers.txt" | tail -n 12
# The transformers cache on the GPU against DynamicCache (logits checked; skipped without transformers)
if python3 -c "import transformers" >/dev/null 2>&1; then
    python3 scripts/bench_hf_cache.py --context 4096 --new 16 --rounds 3 --out "$out/bench_hf_cache.json" 2>&1 \
        | tee "$out/bench_hf_cache.txt" | tail -n 8
fi
echo "== summary =="
tail -n 1 "$out/gpu_tests.txt"
[ -f "$out/bench_hf_cache.txt" ] && grep -E "^(tiered|dynamic|logits)" "$out/bench_hf_cache.txt"
if [ ! -s "$out/bench_tiers.json" ]; then
    echo "bench_tiers.py wrote no JSON (its output: $out/bench_tiers.txt)"; exit 1
fi
python3 - "$out/bench_tiers.json" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
for name, ratio in doc.get("ratios", {}).items():
    print(f"{name:<18} tiercache/raw = {ratio:.3f}")
PY
