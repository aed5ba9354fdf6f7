#!/usr/bin/env bash
# The device half of ../shared/gpu/README.md: on a lent GPU machine, after the parts of
# onnxruntime-gpu were moved to $HOME/ort by earlier calls, unpack them, the benchmark model
# (fp32 and fp16 ONNX, and its checkpoint for the transformers peer) from .gpu/final, and
# run gpu_decode.py; its log and JSON go to $OUT.
set -euo pipefail
B=$PWD/.gpu/final/bin
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
fp16=()
[ -d "$HOME/m/tiled16" ] && fp16=(--fp16-model "$HOME/m/tiled16")
python3 examples/benchmarks/gpu_decode.py --model "$HOME/m/onnx" --checkpoint "$HOME/m/checkpoint" \
  "${fp16[@]}" --device cuda --rows "${ROWS:-1,16,64,256,1024}" --copied-rows "${COPIED:-1,256}" \
  --json "${OUT:-.}/gpu_decode.json" 2>&1 | tee "${OUT:-.}/gpu_decode.log"
