#!/bin/bash
# Paired step_phases: the code before issue 42 (604c335, /work/wt/base) and after (/work/main), alternated.
V1="cache r=1, fused step"
V2="cache r=1, fused step, state on host"
for i in 1 2 3; do
  for side in base main; do
    if [ $side = base ]; then dir=/work/wt/base; else dir=/work/main; fi
    (cd $dir && PYTHONPATH=. /work/main/.venv/bin/python -m perf.step_phases --rounds 12 --warmup 3 --variants "$V1" "$V2" --json /tmp/phases/$side-$i.json > /tmp/phases/$side-$i.txt 2>&1)
  done
done
echo done > /tmp/phases/finished
