#!/usr/bin/env bash
# Every check of this harness; converts the fixtures with the project's CLI first (DSTs under dst/).
set -u; cd "$(dirname "$0")"; ROOT=$(cd ../.. && pwd); C=$ROOT/.venv/bin/atom-convert; S=${FIXTURES:-/tmp/fx/src}
DSTD=${DSTD:-/tmp/plugin-oracle-dst}; mkdir -p "$DSTD"; ln -sfn "$DSTD" dst
cv(){ d=$PWD/dst/$1; shift; rm -rf "$d"; (cd "$ROOT" && $C convert "$@" "$d" >/dev/null) || echo "convert $d failed"; }  # $PWD taken before the cd
cv v3-fp8-plugin $S/v3-fp8 --target gfx950 --profile vllm-plugin
cv kimi-fp8-plugin-tp2ep $S/kimi-fp8 --target gfx950 --profile vllm-plugin --tp 2 --ep
cv kimi-fp8-plugin-tp2 $S/kimi-fp8 --target gfx950 --profile vllm-plugin --tp 2
cv v3-fp8-plugin-tp2ep $S/v3-fp8 --target gfx950 --profile vllm-plugin --tp 2 --ep
cv v3-bf16-plugin $S/v3-bf16 --target gfx950 --profile vllm-plugin
cv v3-mxfp4-plugin $S/v3-mxfp4 --target gfx950 --profile vllm-plugin
cv v3-fp8-plugin-mxbmm $S/v3-fp8 --target gfx950 --profile vllm-plugin --mla-bmm mxfp4
cv v3-fp8-plugin-gfx942 $S/v3-fp8 --target gfx942 --profile vllm-plugin
cv v3-fp8-native $S/v3-fp8 --target gfx950
# sparse-MLA families (DeepSeek-V3.2, GLM-5.2): tiny fixtures from tests/v32_fixtures.py, tests/glm_fixtures.py
V32=${V32_FIXTURE:-/tmp/fam/v32-fp8}; GLM52=${GLM52_FIXTURE:-/tmp/fam/glm52-fp8}
cv v32-fp8-plugin $V32 --target gfx950 --profile vllm-plugin
cv v32-fp8-plugin-tp2ep $V32 --target gfx950 --profile vllm-plugin --tp 2 --ep
cv glm52-fp8-plugin $GLM52 --target gfx950 --profile vllm-plugin
cv glm52-fp8-plugin-tp2 $GLM52 --target gfx950 --profile vllm-plugin --tp 2
# Kimi-K2.5 Quark MXFP4 (tests/k25_fixtures.py). vLLM 0.27.1's KimiK25VisionConfig reads hidden_size,
# num_hidden_layers, num_attention_heads, intermediate_size (defaults: the real model's) and not the checkpoint's
# vt_* keys, so a tiny fixture is copied with both names in its vision_config (values unchanged)
K25=${K25_FIXTURE:-/tmp/fam/k25-mxfp4}; K25V=$DSTD/k25-mxfp4-vllm-src; rm -rf "$K25V"; cp -r "$K25" "$K25V"
python3 - "$K25V/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1])); v = c["vision_config"]
v.update({k: v["vt_" + k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")})
json.dump(c, open(sys.argv[1], "w"), indent=1)
PY
cv k25-mxfp4-plugin $K25V --target gfx950 --profile vllm-plugin
cv k25-mxfp4-plugin-tp2 $K25V --target gfx950 --profile vllm-plugin --tp 2
cv k25-mxfp4-plugin-tp2ep $K25V --target gfx950 --profile vllm-plugin --tp 2 --ep
rc=0
./run_pair.sh v3fp8-tp1-mtp $S/v3-fp8 dst/v3-fp8-plugin 1 --mtp || rc=1
./run_pair.sh kimi-tp2ep $S/kimi-fp8 dst/kimi-fp8-plugin-tp2ep 2 --ep || rc=1
./run_pair.sh kimi-tp2 $S/kimi-fp8 dst/kimi-fp8-plugin-tp2 2 || rc=1
./run_pair.sh v3fp8-tp2ep-mtp $S/v3-fp8 dst/v3-fp8-plugin-tp2ep 2 --ep --mtp || rc=1
./run_pair.sh v3bf16-tp1-mtp $S/v3-bf16 dst/v3-bf16-plugin 1 --mtp || rc=1
./run_pair.sh v3mxfp4-tp1 $S/v3-mxfp4 dst/v3-mxfp4-plugin 1 || rc=1
./run_pair.sh v3fp8-mxbmm-mtp $S/v3-fp8 dst/v3-fp8-plugin-mxbmm 1 --mtp --env ATOM_USE_TRITON_MXFP4_BMM=1 || rc=1
./run_pair.sh v3fp8-gfx942-mtp $S/v3-fp8 dst/v3-fp8-plugin-gfx942 1 --mtp --gfx gfx942 || rc=1
./run_pair.sh v3fp8-nativeprofile-mtp $S/v3-fp8 dst/v3-fp8-native 1 --mtp || rc=1
./run_pair.sh v32fp8-tp1-mtp $V32 dst/v32-fp8-plugin 1 --mtp || rc=1
./run_pair.sh v32fp8-tp2ep-mtp $V32 dst/v32-fp8-plugin-tp2ep 2 --ep --mtp || rc=1
./run_pair.sh glm52fp8-tp1-mtp $GLM52 dst/glm52-fp8-plugin 1 --mtp || rc=1
./run_pair.sh glm52fp8-tp2-mtp $GLM52 dst/glm52-fp8-plugin-tp2 2 --mtp || rc=1
./run_pair.sh k25mxfp4-tp1 $K25V dst/k25-mxfp4-plugin 1 || rc=1
./run_pair.sh k25mxfp4-tp2 $K25V dst/k25-mxfp4-plugin-tp2 2 || rc=1
./run_pair.sh k25mxfp4-tp2ep $K25V dst/k25-mxfp4-plugin-tp2ep 2 --ep || rc=1
./run_dp.sh v3fp8-dp2ep $S/v3-fp8 dst/v3-fp8-plugin-tp2ep 2 --ep   # expected: the project refuses (no such layout)
exit $rc
