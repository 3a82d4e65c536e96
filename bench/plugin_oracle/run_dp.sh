#!/usr/bin/env bash
# usage: run_dp.sh NAME SRC DST DP [extra args]: vLLM DP=N x TP=1 (gloo, N CPU processes), each side, then compare per DP rank
set -u
HERE=$(cd "$(dirname "$0")" && pwd); NAME=$1; SRC=$2; DST=$3; DP=$4; shift 4
ROOT=$(cd "$HERE/../.." && pwd); ORACLE=${ORACLE:-$ROOT/../shared/atom-oracle}
PY=${PLUGIN_VENV:-/tmp/plugin-venv}/bin/python; export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
OUTD=${OUTD:-/tmp/plugin-oracle-out}; mkdir -p "$OUTD"; cd "$HERE"; ln -sfn "$OUTD" out; rc=0
for mode in atom project; do
  dir=$SRC; [ $mode = project ] && dir=$DST
  port=$((29300 + RANDOM % 200)); pids=()
  for ((r=0; r<DP; r++)); do
    $PY plugin_dump.py --mode $mode --model "$dir" --dp $DP --dp-rank $r --port $port "$@" --out out/$NAME-$mode-r$r \
      > out/$NAME-$mode-r$r.log 2>&1 & pids+=($!)
  done
  for p in "${pids[@]}"; do wait $p; done
  for ((r=0; r<DP; r++)); do echo "$mode dp rank $r: $(grep -h -A4 'plugin-dump' out/$NAME-$mode-r$r.log)"; done
done
for ((r=0; r<DP; r++)); do
  $PY "$ORACLE/compare_runtime.py" out/$NAME-atom-r$r out/$NAME-project-r$r --label "$NAME dp rank $r" \
    --json out/$NAME-cmp-r$r.json || rc=1
done
exit $rc
