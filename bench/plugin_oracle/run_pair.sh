#!/usr/bin/env bash
# usage: run_pair.sh NAME SRC DST TP [extra plugin_dump args, e.g. --ep --mtp]
# Runs ATOM's own plugin-mode load of SRC and the project's atom_converted load of DST, TP processes each (vLLM gloo
# world on CPU), then compare_runtime.py per rank. Output under $OUTD (default /tmp/plugin-oracle-out).
set -u
HERE=$(cd "$(dirname "$0")" && pwd); NAME=$1; SRC=$2; DST=$3; TP=$4; shift 4
ROOT=$(cd "$HERE/../.." && pwd); ORACLE=${ORACLE:-$ROOT/../shared/atom-oracle}
PY=${PLUGIN_VENV:-/tmp/plugin-venv}/bin/python; export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
OUTD=${OUTD:-/tmp/plugin-oracle-out}; mkdir -p "$OUTD"; cd "$HERE"; ln -sfn "$OUTD" out; rc=0
for mode in atom project; do
  dir=$SRC; [ $mode = project ] && dir=$DST
  port=$((29600 + RANDOM % 300)); pids=()
  for ((r=0; r<TP; r++)); do
    $PY plugin_dump.py --mode $mode --model "$dir" --tp $TP --rank $r --port $port "$@" --out out/$NAME-$mode-r$r \
      > out/$NAME-$mode-r$r.log 2>&1 & pids+=($!)
  done
  for p in "${pids[@]}"; do wait $p; done
  for ((r=0; r<TP; r++)); do echo "$mode rank $r: $(grep -h '^plugin-dump\[' out/$NAME-$mode-r$r.log | tail -1)"; done
done
for ((r=0; r<TP; r++)); do
  res=$($PY "$ORACLE/compare_runtime.py" out/$NAME-atom-r$r out/$NAME-project-r$r --label "$NAME rank $r" \
    --json out/$NAME-cmp-r$r.json) || rc=1
  echo "$res"
  # compare_runtime.py exits 0 whatever it found: a rank passes only on 'N of N checks hold' (no NOT RUN, no via)
  first=${res%%$'\n'*}
  [[ $first =~ :\ ([0-9]+)\ of\ ([0-9]+)\ checks\ hold$ ]] && [ "${BASH_REMATCH[1]}" = "${BASH_REMATCH[2]}" ] || rc=1
done
exit $rc
