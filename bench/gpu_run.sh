#!/usr/bin/env bash
# The one call for a GPU machine: every GPU check and figure of the project, in ~9 minutes.
#
#   here:   make gpu-wheels        # the wheels the GPU image lacks (xgrammar, pydantic, ...)
#   device: run(command="bash bench/gpu_run.sh", carry=[".whl"], timeout_s=600)
#
# Each part is time-boxed so one hang cannot eat the task's 15 minutes of device time.
# $OUT gets at most 8 files (the device tool's limit): the five JSON results, summary.txt
# and logs.tar.gz. Commit the figures (card, date) to docs/benchmarks/ afterwards.
set -u
OUT=${OUT:-gpu-results}
LOGS=$(mktemp -d)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site
fi
{
  date -u +"date %Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  python3 -c "from importlib.metadata import version as v; print('xgrammar', v('xgrammar'))" 2>&1 | tail -1
} > "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"

part() {  # name, seconds, command...
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"
  tail -n 4 "$LOGS/$name.log"
}

part gpu_check 290 python3 -m bench.gpu_check --out "$OUT"
part attention 170 python3 -m bench.attention --out "$OUT"
part gpu_restore 50 python3 -m bench.gpu_restore --gb 2 --out "$OUT/gpu_restore.json"
part cuda_checkpoint 40 python3 -m bench.cuda_checkpoint --gb 2 --timeout 35 \
  --out "$OUT/cuda_checkpoint.json"
part gpu_quant 45 python3 -m bench.gpu_quant --out "$OUT/gpu_quant.json"  # NOTE: last: the newest
tar -czf "$OUT/logs.tar.gz" -C "$LOGS" .
ls -la "$OUT"
