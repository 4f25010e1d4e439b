#!/usr/bin/env bash
# One command for a bare GPU machine (torch, lightning and transformers installed; no network): the GPU
# checks in priority order, each row printed as it is measured, within a deadline.
#
#   bash benchmarks/gpu_check.sh [--dry-run] [--wheels DIR] [--device cuda|cpu] DEADLINE_S OUT_DIR
#
# --wheels: the project's missing pure-Python dependencies as wheels (default .whl; benchmarks/README.md,
#   "GPU check", says how to fill it here). --device cpu runs the same steps on small shapes, to test the
#   script without a GPU. At most 9 files are left in OUT_DIR.
set -uo pipefail
cd "$(dirname "$0")/.."

dry=0 wheels=.whl device=cuda
while [[ $# -gt 0 && $1 == --* ]]; do
  case $1 in
    --dry-run) dry=1; shift ;;
    --wheels) wheels=$2; shift 2 ;;
    --device) device=$2; shift 2 ;;
    *) echo "gpu_check: unknown option $1" >&2; exit 2 ;;
  esac
done
if [[ $# -ne 2 ]]; then
  echo "usage: bash benchmarks/gpu_check.sh [--dry-run] [--wheels DIR] [--device cuda|cpu] DEADLINE_S OUT_DIR" >&2
  exit 2
fi
deadline=$1 out=$2
start=$SECONDS
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if [[ $device == cuda ]]; then
  xl="llamagen-xl --dtype bf16" big=16 prompts=16 graphs=graphs compiled=compiled presets=all
  train="--targets llamagen-xl --drafters eagle1 eagle3 --modes eager compiled zero2 --batch 8 --steps 4 --warmup 2"
else  # the script's own test: the same steps on a CPU, eager, at sizes it decodes in seconds
  xl="shapes --dtype fp32" big=2 prompts=2 graphs=eager compiled=steps presets="eagle2 sjd"
  train="--targets small --drafters eagle1 eagle3 --ttt-steps 2 --modes eager --batch 2 --steps 2 --warmup 1"
fi
step_cost="python -m benchmarks.step_cost --device $device"

# name | seconds it may take at most | command (run from the repository root)
steps=(
  "tests|120|python -m pytest -q -p no:cacheprovider -m 'gpu and not slow' tests/test_graphs.py tests/test_rng.py"
  "xl_graphs|90|$step_cost --targets $xl --modes $graphs --batch 1 $big --presets eagle2 sjd --out $out/xl_graphs.json"
  "shapes|150|$step_cost --targets shapes --modes $graphs --batch 1 $big --prompts $prompts --presets $presets --out $out/shapes.json"
  "xl_compiled|180|$step_cost --targets $xl --modes $compiled --batch 1 --presets eagle2 sjd --out $out/xl_compiled.json"
  "evaluate|120|python -m vdtrain.evaluate device=$device num_prompts=$prompts batch_size=$big plots=false save_images=false out_dir=/tmp/vdtrain_gpu_eval"
  "train|60|python -m benchmarks.train_throughput --device $device $train --out $out/train.json"
  "xl_eager|90|$step_cost --targets $xl --modes eager --batch 1 --presets eagle2 sjd --out $out/xl_eager.json"
)

if [[ $dry -eq 1 ]]; then
  echo "gpu_check dry run: deadline ${deadline}s, output $out, wheels $wheels, device $device"
  i=1
  for s in "${steps[@]}"; do
    IFS='|' read -r name budget cmd <<<"$s"
    echo "$i. $name (≤ ${budget}s): $cmd"
    i=$((i + 1))
  done
  exit 0
fi

log=$out/gpu_check.log
exec > >(tee -a "$log") 2>&1

# The project's missing pure-Python dependencies, from the wheel folder (no index).
if compgen -G "$wheels/*.whl" >/dev/null; then
  python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/vdtrain_site "$wheels"/*.whl \
    || { echo "gpu_check: installing $wheels/*.whl failed"; exit 1; }
  export PYTHONPATH=$PWD:/tmp/vdtrain_site${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
python - <<'EOF'
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}",
      torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")
EOF

failed=0
for s in "${steps[@]}"; do
  IFS='|' read -r name budget cmd <<<"$s"
  left=$((deadline - (SECONDS - start)))
  if ((left < 20)); then
    echo "== $name: skipped, ${left}s left of the ${deadline}s deadline"
    continue
  fi
  limit=$((budget < left ? budget : left))
  echo "== $name (≤ ${limit}s): $cmd"
  t0=$SECONDS
  timeout -k 5 "$limit" bash -c "$cmd"
  rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0))s$([[ $rc -eq 124 ]] && echo ' (time limit)')"
  ((rc == 0)) || failed=$((failed + 1))
done
if [[ -f /tmp/vdtrain_gpu_eval/results.json ]]; then
  cp /tmp/vdtrain_gpu_eval/results.json "$out/evaluate.json"
fi
echo "gpu_check: $failed step(s) failed, $((SECONDS - start))s in all; files in $out: $(ls "$out" | tr '\n' ' ')"
exit $((failed > 0))
