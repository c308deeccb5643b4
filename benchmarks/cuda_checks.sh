#!/usr/bin/env bash
# The CUDA checks of issues 41 and 45, for a lent GPU machine whose lease is shorter than all of them:
#   bash benchmarks/cuda_checks.sh first SECONDS       the pre-emption agreement on the GPU, then compare.py
#                                                      --device cuda (5 rounds) until SECONDS have passed
#   bash benchmarks/cuda_checks.sh rest SECONDS JSON   the rounds JSON lacks, then the CUDA tests in what is left
# Results go to $OUT (compare's markdown and JSON, every tool's log). Packages the machine lacks travel as
# wheels in .whl (the device tool's README says how); fsmtrain itself as a wheel built here (pip wheel --no-deps).
set -uo pipefail
part=${1:?first or rest}; budget=${2:?seconds}; out=${OUT:-/tmp/cuda-out}; mkdir -p "$out"
start=$SECONDS
left() { local l=$((budget - (SECONDS - start))); echo $((l > 1 ? l : 1)); }
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 3
  export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 WANDB_MODE=offline WANDB_SILENT=true
python3 -c "import fsmtrain, fsmtrain.callbacks, wandb, optuna, transitions, torch; assert torch.cuda.is_available()" \
  || exit 4
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used,utilization.gpu --format=csv
compare=(python3 benchmarks/compare.py --device cuda --rounds 5 --frameworks raw,raw_all,fsm,fsm_all --cli-runs 0
         --timeout 120 --output "$out/RESULTS_cuda.md" --json "$out/cuda.json")
if [ "$part" = first ]; then
  for shape in gpu_mlp small; do
    timeout 120 python3 benchmarks/preempt_poll.py --device cuda --shape "$shape" --steps 1000 2>&1 \
      | grep -v Warning | tee -a "$out/preempt_poll.txt"
  done
  timeout "$(left)" "${compare[@]}" 2>&1 | tee "$out/compare.log" | grep -E "^round|!!!|Summary|/ raw"
else
  timeout "$(left)" "${compare[@]}" --resume "${3:?JSON}" 2>&1 | tee "$out/compare.log" | grep -E "^round|resum|!!!"
  sed -n '/## Summary/,/^## gpu_mlp/p' "$out/RESULTS_cuda.md"
  if [ "$(left)" -gt 60 ]; then
    timeout "$(( $(left) - 10 ))" python3 -m pytest -q -p no:cacheprovider -x --timeout 120 -k cuda \
      tests/test_checkpoint_file.py tests/test_precision.py tests/test_distributed.py 2>&1 | tee "$out/pytest.log" | tail -5
  fi
fi
echo "cuda_checks $part: $((SECONDS - start)) s"
