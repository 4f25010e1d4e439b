#!/usr/bin/env bash
# One command for a bare GPU machine (torch, lightning and transformers installed; no network): the GPU
# checks in priority order, each row printed as it is measured, within a deadline that fits one device call.
#
#   bash benchmarks/gpu_check.sh [--dry-run] [--wheels DIR] [--device cuda|cpu] [--steps A,B] [DEADLINE_S] OUT_DIR
#
# DEADLINE_S: default 540 (one device command may run 600 s; the loan is 15 minutes with the start).
# --wheels: the project's missing pure-Python dependencies as wheels (default .whl; benchmarks/README.md,
#   "GPU check", says how to fill it here). --steps: only these steps (a rerun), in priority order.
# --device cpu runs the same steps on small shapes, to test the script without a GPU (a shared CPU needs a
#   deadline of about 1500).
# OUT_DIR gets two files, each rewritten as soon as a step ends: gpu_check.log and gpu_check.json (per
# step: exit code, seconds, budget, command and the JSON the step wrote).
set -uo pipefail
cd "$(dirname "$0")/.."

dry=0 wheels=.whl device=cuda only=
while [[ $# -gt 0 && $1 == --* ]]; do
  case $1 in
    --dry-run) dry=1; shift ;;
    --wheels) wheels=$2; shift 2 ;;
    --device) device=$2; shift 2 ;;
    --steps) only=",$2,"; shift 2 ;;
    *) echo "gpu_check: unknown option $1" >&2; exit 2 ;;
  esac
done
if [[ $# -eq 1 || $# -eq 2 ]] && [[ $# -eq 1 || $1 =~ ^[0-9]+$ ]]; then
  deadline=540
  [[ $# -eq 2 ]] && { deadline=$1; shift; }
  out=$1
else
  echo "usage: bash benchmarks/gpu_check.sh [--dry-run] [--wheels DIR] [--device cuda|cpu] [--steps A,B] [DEADLINE_S] OUT_DIR" >&2
  exit 2
fi
start=$SECONDS
stage=${TMPDIR:-/tmp}/vdtrain_gpu_check.$$  # what each step writes, before it is merged into OUT_DIR
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# The image's pytest plugins may not match a carried pytest; the tests need none.
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1

if [[ $device == cuda ]]; then
  xl="llamagen-xl --dtype bf16" pair="eagle2 sjd" scale=1 big=16 prompts=8 eval_prompts=16 eval= graphs=graphs compiled=compiled presets=all
  profile="--target llamagen-xl --dtype bf16 --steps 4"
  seven_b="--targets chameleon-7b janus-pro-7b --dtype bf16 --steps 24"  # random weights; 24 steps a decode
  train="--targets llamagen-xl --drafters eagle1 eagle3 --modes eager zero2 compiled --batch 8 32 --steps 3 --warmup 2 --reference-loss"
  scaling="--target grain --minutes 2 --points 2048 --batch 16 --precision bf16-mixed"
  calibration="--num-prompts 512 --batch-size 64"  # captions 32-511 cached first: python -m data_prep.captions target=grain
  # issue #54: the memory plan against max_memory_allocated, and a 7B-class step under ZeRO-2 (2 layers)
  plan_check="--agreement llamagen-xl janus-pro-7b lumina-mgpt-7b-768 --layers 2 --kinds eagle1 eagle3 --batch 1 8 --precisions bf16-mixed"
  big_train="--targets janus-pro-7b lumina-mgpt-7b-768 --layers 2 --drafters eagle1 --modes eager zero2 --batch 8 --steps 3 --warmup 2"
  block="block block_tree block_tree_iid eagle1 eagle2 sjd"  # issue #55, item 5: the block presets beside the ones they beat
else  # the script's own test: the same steps on a CPU, eager, at small sizes, each given 4x its budget
  xl="shapes --dtype fp32" pair=sjd scale=4 big=2 prompts=2 eval_prompts=2 eval="eval=fast acceptance.enabled=false" graphs=eager compiled=steps presets=scd
  profile="--target shapes --steps 1 --skip 1"
  seven_b="--targets chameleon-7b janus-pro-7b --layers 1 --dtype bf16 --steps 4"  # one layer of each
  train="--targets small --drafters eagle1 eagle3 --ttt-steps 2 --modes eager --batch 1 2 --steps 1 --warmup 1"
  scaling="--target shapes --minutes 0.3 --points 16 --batch 2 --val-samples 4 --ttt-steps 2 --threads 2"
  calibration="--num-prompts 2 --batch-size 2 --methods eagle1 sjd"
  plan_check="--agreement grain --kinds eagle1 --batch 1 --precisions 32-true"
  big_train="--targets anole-7b --layers 1 --drafters eagle1 --modes eager --batch 1 --steps 1 --warmup 1"
  block="block block_tree block_tree_iid"
fi
step_cost="python -m benchmarks.step_cost --device $device"

# name | seconds it may take at most | command (run from the repository root; it writes $stage/NAME.json).
# Budgets: estimated from the H200 run's JSON (docs/evaluation/gpu_h200; benchmarks/README.md, "GPU check").
# --presets all includes the SCD presets (scd, scd_gumbel, sjd_pac_gumbel).
steps=(
  "tests|45|python -m pytest -q -o addopts=-ra -p no:cacheprovider -m 'gpu and not slow' tests/test_graphs.py tests/test_rng.py"
  # what a user runs, each command as the README writes it (fit with its after-epoch evaluation, DeepSpeed
  # stages 2 and 3, a SIGKILL and resume=last, export, evaluate, generate); needs the cached training captions
  "user|150|python -m benchmarks.user_commands --device $device --work $stage/user_runs --out $stage/user.json"
  "xl_graphs|75|$step_cost --targets $xl --modes $graphs --batch 1 $big --presets $pair --out $stage/xl_graphs.json"
  "big|100|$step_cost $seven_b --modes $graphs --batch 1 $big --presets $pair --out $stage/big.json"
  "profile|75|python -m benchmarks.step_profile --device $device $profile --presets $pair --out $stage/profile.json"
  "xl_compiled|160|$step_cost --targets $xl --modes $compiled --batch 1 --presets $pair --out $stage/xl_compiled.json"
  "shapes|100|$step_cost --targets shapes --modes $graphs --batch 1 $big --prompts $prompts --presets $presets --out $stage/shapes.json"
  "grain|130|$step_cost --targets grain --modes $graphs --batch 1 $big --prompts $prompts --presets $presets --out $stage/grain.json"
  "shapes_compiled|110|$step_cost --targets shapes --modes $compiled --batch 1 --prompts $prompts --presets $pair --out $stage/shapes_compiled.json"
  "train|300|python -m benchmarks.train_throughput --device $device $train --out $stage/train.json"
  "evaluate|60|python -m vdtrain.evaluate $eval device=$device num_prompts=$eval_prompts batch_size=$big plots=false save_images=false out_dir=$stage/evaluate && cp $stage/evaluate/results.json $stage/evaluate.json"
  "xl_eager|80|$step_cost --targets $xl --modes eager --batch 1 --presets $pair --out $stage/xl_eager.json"
  # optional, only when named (bash benchmarks/gpu_check.sh --steps scaling 400 OUT): issue #35's curve
  "scaling|330|python -m benchmarks.data_scaling --device $device $scaling --work-dir $stage/scaling --out $stage/scaling.json"
  # optional: issue #46's 7B-class shapes compiled (inductor takes about a minute per method and shape)
  "big_compiled|300|$step_cost $seven_b --modes $compiled --batch 1 --presets $pair --out $stage/big_compiled.json"
  # optional: issue #32's calibration of the grain world at 512 held-out captions (it writes a folder)
  "grain_calibration|300|python -m benchmarks.calibration --device $device $calibration --units $stage/grain_units --out $stage/grain_calibration"
  # optional: issue #54's memory plan, each row's step peak against max_memory_allocated (plan within 15 %)
  "plan_check|150|python -m benchmarks.memory_plan $plan_check --device $device --out $stage/plan_check.json"
  # optional: issue #54's 7B-class training step at 2 layers, eager and under ZeRO-2 (fit's evaluation: big_fit)
  "big_train|150|python -m benchmarks.train_throughput --device $device $big_train --out $stage/big_train.json"
  # optional: issue #54's fit at a 7B-class width (2 layers, bf16 target) under ZeRO-2, evaluated after its epochs
  "big_fit|240|python -m benchmarks.big_fit --device $device --work $stage/big_fit_runs --out $stage/big_fit.json"
  # optional: issue #55's block presets at XL and at the 7B-class shapes, B 1, graphs then compiled (r, latency)
  "block_xl|120|$step_cost --targets $xl --modes $graphs --batch 1 --presets $block --out $stage/block_xl.json"
  "block_big|150|$step_cost $seven_b --modes $graphs --batch 1 --presets $block --out $stage/block_big.json"
  "block_xl_compiled|250|$step_cost --targets $xl --modes $compiled --batch 1 --presets $block --out $stage/block_xl_compiled.json"
  # optional: issue #54's export after ZeRO-2 and ZeRO-3, gathered and equal to DDP's, on 2 GPUs (fewer if fewer)
  "zero_export|240|python -m benchmarks.zero_export --devices 2 --work $stage/zero_runs --out $stage/zero_export.json"
)

# The second prepared call (540 s): bash benchmarks/gpu_check.sh --steps plan_check,big_train,big_fit OUT
# (the third, where two GPUs are lent: --steps zero_export; issue #55's: --steps block_xl,block_big,block_xl_compiled)
optional=",scaling,big_compiled,grain_calibration,zero_export,plan_check,big_train,big_fit,block_xl,block_big,block_xl_compiled,"  # steps a full run leaves out (each takes minutes of a 15-minute loan)
chosen=()
for s in "${steps[@]}"; do
  name=${s%%|*}
  if [[ -n $only ]]; then [[ $only == *",$name,"* ]] && chosen+=("$s")
  elif [[ $optional != *",$name,"* ]]; then chosen+=("$s")
  fi
done
if [[ ${#chosen[@]} -eq 0 ]]; then echo "gpu_check: no step named in --steps ${only:1:-1}" >&2; exit 2; fi
steps=("${chosen[@]}")

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

mkdir -p "$out"
mkdir -p "$stage"
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
import importlib.util, torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}",
      torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")
names = ["hydra", "omegaconf", "pytest", "pluggy", "iniconfig", "deepspeed", "scipy", "matplotlib"]
print("packages:", ", ".join(f"{n} {'yes' if importlib.util.find_spec(n) else 'no'}" for n in names))
EOF

# Merges one step's outcome into OUT_DIR/gpu_check.json, with what it wrote: NAME.json, or a folder NAME/
# whose .json files are kept parsed and .md files as text.
record() {
  python - "$out/gpu_check.json" "$stage" "$device" "$deadline" "$@" <<'EOF'
import json, sys
from pathlib import Path
path, stage, device, deadline, name, rc, seconds, budget, cmd = sys.argv[1:]
summary = json.loads(Path(path).read_text()) if Path(path).exists() else {"device": device, "deadline_s": int(deadline), "steps": {}}
result, folder = Path(stage) / f"{name}.json", Path(stage) / name
if result.exists():
    written = json.loads(result.read_text())
elif folder.is_dir():
    written = {f.name: json.loads(f.read_text()) if f.suffix == ".json" else f.read_text()
               for f in sorted(folder.iterdir()) if f.suffix in (".json", ".md")}
else:
    written = None
summary["steps"][name] = {"rc": int(rc), "seconds": int(seconds), "budget_s": int(budget), "command": cmd,
                          "result": written}
Path(path).write_text(json.dumps(summary, indent=1) + "\n")
EOF
}

failed=0
for s in "${steps[@]}"; do
  IFS='|' read -r name budget cmd <<<"$s"
  left=$((deadline - (SECONDS - start)))
  if ((left < 20)); then
    echo "== $name: skipped, ${left}s left of the ${deadline}s deadline"
    continue
  fi
  budget=$((budget * scale))
  limit=$((budget < left ? budget : left))
  echo "== $name (≤ ${limit}s): $cmd"
  t0=$SECONDS
  timeout -k 5 "$limit" bash -c "$cmd"
  rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0))s$([[ $rc -eq 124 ]] && echo ' (time limit)')"
  ((rc == 0)) || failed=$((failed + 1))
  record "$name" "$rc" "$((SECONDS - t0))" "$budget" "$cmd"
done
echo "gpu_check: $failed step(s) failed, $((SECONDS - start))s in all; files in $out: $(ls "$out" | tr '\n' ' ')"
exit $((failed > 0))
