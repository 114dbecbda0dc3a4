#!/usr/bin/env bash
# Everything that needs a GPU, in one call that fits a lent machine's budget (one command
# may run 10 minutes; the whole check stays under 8, a part that hangs included).
#
#   bash perf/gpu_check.sh [--quick] [--dry-run]
#
# Parts run most valuable first, each under its own timeout and a global deadline; each
# writes its log (and JSON, where it makes one) to $OUT (else perf/results/gpu/) as soon as
# it ends, and a line to summary.tsv, so a call killed midway keeps what it had. --quick
# runs the first four parts with shorter timeouts (under 3 minutes): for a rerun.
# --dry-run prints the parts and their timeouts and exits (no CUDA needed).
#
# Uses the python3 on PATH as it is (on a lent H200 it holds a CUDA build of torch, pytest
# and pytest-benchmark) and this checkout's package. Exits non-zero if any part failed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

quick=0
dry_run=0
for arg in "$@"; do
    case "$arg" in
        --quick) quick=1 ;;
        --dry-run) dry_run=1 ;;
        *) echo "gpu_check.sh: unknown argument '$arg'; usage: bash perf/gpu_check.sh [--quick] [--dry-run]" >&2
           exit 2 ;;
    esac
done

out="${OUT:-perf/results/gpu}"
budget=$(( quick ? 170 : 470 ))  # seconds, for every part together
# name | timeout (s) | quick timeout (0: not in --quick) | command
parts=(
    "tests_sync_and_races|100|60|python3 -m pytest -q -rs -p no:cacheprovider -k 'never_wait or race or widened or pinned_pool or bit_for_bit' tests/test_cuda.py"
    "memory_table|60|40|python3 -m perf.memory_report --device cuda --json $out/memory_cuda.json"
    "link_and_pinned_pool|30|20|python3 -m perf.gpu_link --json $out/gpu_link.json"
    "step_time|120|40|python3 perf/gpu_report.py --json $out/gpu_report.json QUICK_FLAG"
    "tests_cuda_rest|60|0|python3 -m pytest -q -rs -p no:cacheprovider -k 'cuda or Cuda' tests/test_cuda.py tests/test_accounting.py tests/test_training.py tests/test_eight_bit.py"
    "fsdp2_example|40|0|python3 -m torch.distributed.run --nproc-per-node 1 examples/train_fsdp.py --steps 10"
    "sanitizer|60|0|TORCH_CUDA_SANITIZER=1 python3 -m pytest -q -rs -p no:cacheprovider -k 'bit_for_bit or exact' tests/test_cuda.py"
    "peers_cuda|180|0|python3 -m perf.peers --device cuda --contenders cpu-offload cpu-offload-grads fsdp-offload cache-fused bnb cache-fused-bnb in-backward cache-apply cache-default torchao --json $out/peers_cuda.json"
)

if (( dry_run )); then
    total=0
    for part in "${parts[@]}"; do
        IFS='|' read -r name full short command <<< "$part"
        limit=$(( quick ? short : full ))
        (( limit == 0 )) && continue
        total=$(( total + limit ))
        echo "$name $limit"
    done
    echo "total $total budget $budget"
    exit 0
fi

python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null || {
    echo "gpu_check.sh needs a CUDA device: this python3 has no torch that sees one (torch.cuda.is_available() is not True). Nothing was run." >&2
    exit 1
}
mkdir -p "$out"
printf 'part\tstatus\tseconds\n' > "$out/summary.tsv"
python3 -c "import torch; print('torch', torch.__version__, 'on', torch.cuda.get_device_name())" \
    | tee "$out/device.txt"
start=$SECONDS
status=0
for part in "${parts[@]}"; do
    IFS='|' read -r name full short command <<< "$part"
    limit=$(( quick ? short : full ))
    (( limit == 0 )) && continue
    left=$(( budget - (SECONDS - start) ))
    if (( left < 10 )); then
        printf '%s\tskipped (budget)\t0\n' "$name" | tee -a "$out/summary.tsv"
        status=1
        continue
    fi
    (( limit > left )) && limit=$left
    command="${command//QUICK_FLAG/$( (( quick )) && echo --quick )}"
    began=$SECONDS
    timeout --kill-after=5 "$limit" bash -c "$command" > "$out/$name.log" 2>&1
    code=$?
    case $code in
        0) result=passed ;;
        124|137) result="timed out (${limit} s)"; status=1 ;;
        *) result="failed (exit $code)"; status=1 ;;
    esac
    printf '%s\t%s\t%s\n' "$name" "$result" "$(( SECONDS - began ))" | tee -a "$out/summary.tsv"
done

echo
echo "== summary ($(( SECONDS - start )) s; logs in $out) =="
column -t -s $'\t' "$out/summary.tsv" 2>/dev/null || cat "$out/summary.tsv"
for figures in link_and_pinned_pool memory_table step_time; do
    [[ -s "$out/$figures.log" ]] && { echo; echo "-- $figures (tail)"; tail -n 12 "$out/$figures.log"; }
done
exit "$status"
