#!/usr/bin/env bash
# Everything that needs a GPU, in one call that fits a lent machine's budget: a session has
# 15 device minutes, the machine's start (1-2) included, so the full check stays within 420 s
# and a --quick rerun after it within 180 s, a part that hangs included.
#
#   bash perf/gpu_check.sh [--quick] [--dry-run]
#
# Setup first, under its own timeouts (the device query, then the preflight: SETUP_S in
# all); then the parts, most valuable first, each under its own timeout and a deadline that
# starts once the preflight is over (the parts' timeouts plus a little slack for their
# kill-after), so setup time never cuts the last part. Each part writes its log (and JSON,
# where it makes one) to $OUT (else perf/results/gpu/) as soon as it ends, and a line to
# summary.tsv, so a call killed midway keeps what it had. --quick runs the first four parts
# with shorter timeouts: for a rerun.
#
# A preflight first imports what each part needs and says plainly what is missing: a part
# that cannot import is skipped (and the check fails), and the peers that need
# bitsandbytes or torchao are left out, with a line saying so, where those are absent.
#
# --dry-run (no CUDA needed) runs the preflight, prints each part and its timeout, and
# checks each pytest part's selection on the CPU: its exact command (less environment
# settings) plus --collect-only, which with the command's -q lists the ids, printed
# indented after the count (with --quick, the same commands are not collected again); it
# exits non-zero if an import fails or a selection is empty or does not collect.
#
# Uses $PYTHON, else the python3 on PATH, as it is (on a lent H200: a CUDA build of torch,
# pytest, psutil, hypothesis), and this checkout's package: no install, no build step.
# Exits non-zero if any part failed or was skipped.
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
py="${PYTHON:-python3}"
device_s=20     # the device query (is CUDA there; its name)
preflight_s=30  # the preflight's imports
slack_s=$(( quick ? 8 : 15 ))  # the parts' kill-after (5 s each at most), within the deadline
# pyproject's addopts holds --benchmark-disable, which pytest refuses (exit 4) where
# pytest-benchmark is absent: the parts' pytest runs without it, and writes no cache.
pytest="$py -m pytest -q -rs -p no:cacheprovider -o addopts="
# Part 1's selection of tests/test_cuda.py; tests_cuda_rest runs every other CUDA test (not
# the "stand-in cuda" variants, which run on CPU tensors in CI).
races="never_wait or race or widened or pinned_pool"
# The peers on CUDA, in this order, with the package each needs beyond torch (key:package).
peers=(cpu-offload:torchao cpu-offload-grads:torchao fsdp-offload cache-fused-state cache-fused
       bnb:bitsandbytes cache-fused-bnb:bitsandbytes in-backward cache-apply cache-default
       torchao:torchao)
# name | timeout (s) | quick timeout (0: not in --quick) | modules to import | command
# tests_cuda_rest holds the stand-ins of issue 41's GPU items (test_cuda.py): a budget that
# keeps some gradients fits at a clipped step with one copy of each, the step's end leaves
# the host free, the host state's bytes, a post-hook reading final state.
parts=(
    "tests_sync_and_races|85|55|pytest,gradient_cache|$pytest -k '$races' tests/test_cuda.py"
    "memory_table|35|25|perf.memory_report|$py -m perf.memory_report --device cuda --json $out/memory_cuda.json"
    "link_and_pinned_pool|15|12|perf.gpu_link|$py -m perf.gpu_link --json $out/gpu_link.json"
    "step_time|55|30|perf.gpu_report|$py perf/gpu_report.py --json $out/gpu_report.json QUICK_FLAG"
    # Issue 43 (issue 50 item 4): the device capped at half a model's fp32 weights, plain
    # refused at placement, the cache set up from the host (device=) with the weights,
    # gradients and state there: the allocator's peaks and retries under the cap, plain's
    # bits, the step time against the planner's floor; its JSON rewritten as each run ends.
    "larger_than_device|30|0|perf.larger_than_device|$py -m perf.larger_than_device --device cuda --json $out/larger_than_device.json"
    "tests_cuda_rest|65|0|pytest,gradient_cache|$pytest -k 'cuda and not stand and not ($races)' tests/test_cuda.py tests/test_accounting.py tests/test_training.py tests/test_layout.py"
    # The same tests as the parts above, under PyTorch's CUDA sanitizer: a failure here
    # and not there is a stream race the sanitizer saw.
    "sanitizer|25|0|pytest,gradient_cache|TORCH_CUDA_SANITIZER=1 $pytest -k 'widened or exact' tests/test_cuda.py"
    "fsdp2_example|15|0|torch.distributed.fsdp,gradient_cache.demo.models|$py -m torch.distributed.run --nproc-per-node 1 examples/train_fsdp.py --steps 10"
    "peers_cuda|30|0|perf.peers|$py -m perf.peers --device cuda --no-search --contenders PEERS --json $out/peers_cuda.json"
)
# The parts' deadline: every part's timeout in this mode, plus the slack.
total=0
for part in "${parts[@]}"; do
    IFS='|' read -r name full short needs command <<< "$part"
    total=$(( total + (quick ? short : full) ))
done
budget=$(( total + slack_s ))
setup=$(( device_s + preflight_s ))

# Prints "missing<TAB>part<TAB>why" for each part with a module that does not import, and
# "absent<TAB>package" for each of the peers' optional packages not installed.
preflight() {
    local spec="" part name full short needs command
    for part in "${parts[@]}"; do
        IFS='|' read -r name full short needs command <<< "$part"
        spec+="$name $needs"$'\n'
    done
    timeout --kill-after=5 "$preflight_s" "$py" - "$spec" <<'PYTHON'
import importlib
import importlib.util
import sys

why = {}
for line in sys.argv[1].splitlines():
    part, needs = line.split(" ", 1)
    for module in needs.split(","):
        if module not in why:
            try:
                importlib.import_module(module)
                why[module] = None
            except Exception as error:  # ModuleNotFoundError names the module missing
                why[module] = f"import {module} fails ({type(error).__name__}: {error})"
        if why[module]:
            print(f"missing\t{part}\t{why[module]}")
            break
for package in ("bitsandbytes", "torchao"):
    try:
        found = importlib.util.find_spec(package) is not None
    except ImportError:
        found = False
    if not found:
        print(f"absent\t{package}")
PYTHON
}

# Runs the preflight; fills `missing` (part: why) and `contenders`, and prints its findings.
declare -A missing=()
contenders=()
run_preflight() {
    local kind what why absent=" " entry key package report
    report=$(preflight)
    local code=$?
    if (( code != 0 )); then
        echo "preflight: $py could not run the import check (exit $code)"
        return 1
    fi
    while IFS=$'\t' read -r kind what why; do
        case $kind in
            missing) missing[$what]=$why
                     echo "preflight: $what will be skipped: $why" ;;
            absent) absent+="$what " ;;
        esac
    done <<< "$report"
    declare -A left_out=()
    for entry in "${peers[@]}"; do
        key=${entry%%:*}
        package=${entry#"$key"}
        package=${package#:}
        if [[ -n $package && $absent == *" $package "* ]]; then
            left_out[$package]+=" $key"
        else
            contenders+=("$key")
        fi
    done
    for package in "${!left_out[@]}"; do
        echo "preflight: peers_cuda leaves out${left_out[$package]}: $package is not installed"
    done
    (( ${#missing[@]} == 0 ))
}

if (( dry_run )); then
    run_preflight >&2
    failed=$?
    for part in "${parts[@]}"; do
        IFS='|' read -r name full short needs command <<< "$part"
        limit=$(( quick ? short : full ))
        (( limit == 0 )) && continue
        # --quick runs the same commands, only with shorter timeouts: collected once, in
        # the full dry run. A part the preflight refused says why instead.
        if (( quick )) || [[ $command != *" -m pytest "* || -n ${missing[$name]+set} ]]; then
            echo "$name $limit"
            continue
        fi
        # Environment settings go: the sanitizer needs CUDA even to collect.
        collect=$command
        while [[ $collect =~ ^[A-Za-z_][A-Za-z0-9_]*=[^[:space:]]*[[:space:]]+ ]]; do
            collect=${collect#"${BASH_REMATCH[0]}"}
        done
        listing=$(timeout 120 bash -c "$collect --collect-only" 2>&1)
        code=$?
        ids=$(grep -E '^[^[:space:]]+::' <<< "$listing")
        count=$(grep -cE '^[^[:space:]]+::' <<< "$listing")
        echo "$name $limit selects $count tests"
        [[ -n $ids ]] && sed 's/^/    /' <<< "$ids"
        if (( code != 0 || count == 0 )); then
            echo "dry run: $name's selection failed (pytest exit $code, $count tests):" >&2
            tail -n 20 <<< "$listing" >&2
            failed=1
        fi
    done
    echo "total $total budget $budget setup $setup whole $(( setup + budget ))"
    exit "$failed"
fi

device=$(timeout --kill-after=5 "$device_s" "$py" -c "import torch, sys
if not torch.cuda.is_available():
    sys.exit(1)
print('torch', torch.__version__, 'on', torch.cuda.get_device_name())" 2>/dev/null) || {
    echo "gpu_check.sh needs a CUDA device: this $py has no torch that sees one (torch.cuda.is_available() is not True). Nothing was run." >&2
    exit 1
}
mkdir -p "$out"
printf 'part\tstatus\tseconds\n' > "$out/summary.tsv"
echo "$device" | tee "$out/device.txt"
run_preflight > "$out/preflight.txt"
cat "$out/preflight.txt"
start=$SECONDS  # the parts' deadline counts from here: the preflight cuts no part
status=0
for part in "${parts[@]}"; do
    IFS='|' read -r name full short needs command <<< "$part"
    limit=$(( quick ? short : full ))
    (( limit == 0 )) && continue
    if [[ -n ${missing[$name]+set} ]]; then
        printf '%s\tskipped (%s)\t0\n' "$name" "${missing[$name]}" | tee -a "$out/summary.tsv"
        status=1
        continue
    fi
    left=$(( budget - (SECONDS - start) ))
    if (( left < 10 )); then
        printf '%s\tskipped (budget)\t0\n' "$name" | tee -a "$out/summary.tsv"
        status=1
        continue
    fi
    (( limit > left )) && limit=$left
    command="${command//QUICK_FLAG/$( (( quick )) && echo --quick )}"
    command="${command//PEERS/${contenders[*]}}"
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
echo "== summary (parts $(( SECONDS - start )) s of $budget, all $SECONDS s; logs in $out) =="
column -t -s $'\t' "$out/summary.tsv" 2>/dev/null || cat "$out/summary.tsv"
for figures in link_and_pinned_pool memory_table step_time; do
    [[ -s "$out/$figures.log" ]] && { echo; echo "-- $figures (tail)"; tail -n 12 "$out/$figures.log"; }
done
exit "$status"
