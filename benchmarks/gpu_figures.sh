#!/usr/bin/env bash
# Every GPU figure of the fleet-scale benchmarks in one run (docs/results.md, "On a GPU").
#
#   bash benchmarks/gpu_figures.sh OUTDIR [SCALE]
#
# OUTDIR receives one JSON file per benchmark and log.txt. SCALE (default 1) divides every
# fleet size, so that `DEVICE=cpu bash benchmarks/gpu_figures.sh check 100` checks the script in a
# minute, on a CPU too (DEVICE=cpu). Each step has its own time limit (seconds, STEP_LIMIT_*),
# and a step that fails or runs out of time does not stop the next one; a failed smoke test
# (a few devices, every strategy the figures use) stops the run at once.
set -u
out=${1:?usage: gpu_figures.sh OUTDIR [SCALE]}
scale=${2:-1}
device=${DEVICE:-cuda}
python=${PYTHON:-python3}
mkdir -p "$out"
log="$out/log.txt"
total=${TOTAL_LIMIT:-540}  # seconds for the whole run: the last step gets what is left
left() { echo $(( total - SECONDS > 30 ? total - SECONDS : 30 )); }
n() { echo $(( $1 / scale > 2 ? $1 / scale : 2 )); }

step() {  # step NAME LIMIT COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit} s): $*" | tee -a "$log"
    local start=$SECONDS
    timeout --signal=KILL "$limit" "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc after $(( SECONDS - start )) s" | tee -a "$log"
    return "$rc"
}

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || true
    nproc
    "$python" -c "import torch, sys; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
} 2>&1 | tee -a "$log"

step smoke "${STEP_LIMIT_SMOKE:-120}" "$python" -m benchmarks.cohort --models lenet5 --devices 20 \
    --strategies fedavg,fedkf --engines batched,loop --loop-sample 4 --device "$device" \
    || { echo "smoke test failed: stopping" | tee -a "$log"; exit 1; }

step cohort-1k "${STEP_LIMIT_COHORT:-150}" "$python" -m benchmarks.cohort --models lenet5 \
    --devices "$(n 1000)" --strategies fedavg,fedkf --engines batched,loop,bound \
    --device "$device" --json "$out/cohort_1k.json"
one='{"engine": "batched", "model": "lenet5", "strategy": "fedavg", "devices": '"$(n 1000)"
one+=', "device": "'"$device"'", "samples": 300, "loop_sample": 50, "max_cohort": null, "data_dir": null}'
step profile-1k "${STEP_LIMIT_PROFILE:-90}" "$python" -c '
import cProfile, pstats, sys
from benchmarks.cohort import run_one
import json
options = json.loads(sys.argv[1])
run_one(dict(options, devices=20))  # warm: CUDA context, kernels
profile = cProfile.Profile()
profile.enable()
row = run_one(options)
profile.disable()
print(row)
pstats.Stats(profile).sort_stats("tottime").print_stats(25)
pstats.Stats(profile).sort_stats("cumulative").print_stats(30)
' "$one"
step cohort-10k "${STEP_LIMIT_COHORT_10K:-150}" "$python" -m benchmarks.cohort --models lenet5 \
    --devices "$(n 10000)" --strategies fedavg --engines batched --device "$device" \
    --json "$out/cohort_10k.json"
step scale-1k "${STEP_LIMIT_SCALE:-150}" "$python" -m benchmarks.scale --devices "$(n 1000)" \
    --transports inproc --rounds 3 --coordinator-devices '' --device "$device" \
    --json "$out/scale_1k.json"
step scale-10k "$(left)" "$python" -m benchmarks.scale \
    --devices "$(n 10000)" --transports inproc --rounds 2 --coordinator-devices '' \
    --device "$device" --json "$out/scale_10k.json"
echo "done" | tee -a "$log"
