#!/usr/bin/env bash
# The device half of ../shared/gpu/README.md: on a lent GPU machine, after the parts of
# onnxruntime-gpu were moved to $HOME/ort by earlier calls, unpack them, the benchmark model
# (fp32 and fp16 ONNX, and its checkpoint for the transformers peer) from .gpu/final, and
# run gpu_decode.py, then capacity.py on the GPU when .gpu/final holds the FLORES zh
# sentences (zho_Hans.devtest); logs and JSON go to $OUT. Each part has its time limit
# (DECODE_S, CAPACITY_S), so that one call of a lent machine's few minutes gives both.
# Several engine processes on the one GPU: PROCESSES=8 MAX_ROWS=256 (each its own model
# and KV pool: MAX_ROWS slots of 12.6 MB in fp16). TIMELINE=1: capacity.py prints where
# each lane's time went (waiting, encode, prefill, steps) per N, and writes the turns.
set -euo pipefail
B=$PWD/.gpu/final/bin
OUT=${OUT:-.}
mkdir -p "$HOME/site" "$HOME/m"
if [ ! -d "$HOME/site/onnxruntime" ]; then
  cat "$HOME"/ort/part.* | LD_LIBRARY_PATH=$B "$B/zstd" -d --long=30 | tar x -C "$HOME/site"
fi
for t in model ckpt m16; do
  [ -f ".gpu/final/$t.tar.zst" ] && LD_LIBRARY_PATH=$B "$B/zstd" -d --long=30 < ".gpu/final/$t.tar.zst" | tar x -C "$HOME/m"
done
export PYTHONPATH=$HOME/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python3 -c "import onnxruntime as o; o.preload_dlls(); print('onnxruntime', o.__version__, o.get_available_providers())"
if [ "${DECODE:-1}" = 1 ]; then
  fp16=()
  [ -d "$HOME/m/tiled16" ] && fp16=(--fp16-model "$HOME/m/tiled16")
  timeout "${DECODE_S:-240}" python3 examples/benchmarks/gpu_decode.py --model "$HOME/m/onnx" \
    --checkpoint "$HOME/m/checkpoint" "${fp16[@]}" --device cuda --rows "${ROWS:-1,16,64,256,1024}" \
    --copied-rows "${COPIED:-}" --reps "${REPS:-3}" --profile-rows "${PROFILE:-0}" \
    --json "$OUT/gpu_decode.json" 2>&1 \
    | grep --line-buffered -v "max_new_tokens\|plugin EP\|ScatterND" | tee "$OUT/gpu_decode.log" || true
fi
if [ -f .gpu/final/zho_Hans.devtest ] && [ "${CAPACITY:-1}" = 1 ]; then
  timeout "${CAPACITY_S:-220}" python3 examples/benchmarks/capacity.py \
    --model "$HOME/m/${CAPACITY_MODEL:-tiled16}" --fp32 --device cuda --lanes 1 \
    --max-rows "${MAX_ROWS:-2048}" --streams "${STREAMS:-500,1000,2000}" \
    --processes "${PROCESSES:-1}" ${TIMELINE:+--timeline "$OUT/timeline"} \
    --sentences "${SENTENCES:-2}" --no-final-check --sources .gpu/final/zho_Hans.devtest \
    --json "$OUT/capacity.json" 2>&1 | grep --line-buffered -v "plugin EP\|ScatterND" \
    | tee "$OUT/capacity.log" || true
fi
