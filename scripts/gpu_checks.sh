#!/usr/bin/env bash
# The project's GPU checks in priority order, as one command that ends within 8 minutes.
#
#   scripts/gpu_checks.sh                              # the default checks, in order, on a CUDA machine
#   scripts/gpu_checks.sh presets                      # named checks only (the ones below the default set too)
#   scripts/gpu_checks.sh --cpu-smoke [NAMES...]       # every check's code path on tiny models on the CPU (a test runs it)
#
# Each check runs under its own cap (`timeout`), keeps its log in $OUT/NAME.log and appends its
# readings to $OUT/results.jsonl, one JSON object per line; after each check the script appends
# {"check": NAME, "exit": STATUS, "seconds": S} (exit 124: stopped at its cap; what it appended
# before stays). The summary at the end prints results.jsonl, the rows for BENCHMARKS.md.
# $OUT defaults to ./gpu_checks_out. Delete a check once BENCHMARKS.md has its GPU number.
#
# The GPU machine has torch, transformers, accelerate and peft, but not diffusers, torchao or
# omegaconf: put their wheels in .whl/ first (python 3.12, manylinux x86_64), e.g.
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform any -d .whl diffusers==0.42.1 torchao==0.18.0 omegaconf==2.4.0
set -uo pipefail
cd "$(dirname "$0")/.."
SMOKE=0
if [ "${1:-}" = "--cpu-smoke" ]; then SMOKE=1; shift; fi
CHECKS=("$@")
OUT="${OUT:-gpu_checks_out}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
RESULTS="$OUT/results.jsonl"
PY="${PYTHON:-python3}"
if [ "$SMOKE" = 1 ]; then
  export PYTHONPATH="$PWD"
  echo "cpu smoke run: the code paths on tiny models, no readings" | tee "$OUT/machine.txt"
else
  if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site:$PWD"
  else
    export PYTHONPATH="$PWD"
  fi
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/machine.txt"
fi
export PYTHONUNBUFFERED=1
"$PY" -c "import torch, diffusers; print('torch', torch.__version__, 'diffusers', diffusers.__version__)" | tee -a "$OUT/machine.txt"

wanted() {  # wanted NAME DEFAULT: named on the command line, or no names given and NAME is a default check
  if [ ${#CHECKS[@]} -eq 0 ]; then [ "$2" = default ]; else [[ " ${CHECKS[*]} " == *" $1 "* ]]; fi
}
run() {  # run NAME SECONDS CMD...: one check under its cap, its log in $OUT/NAME.log, its status in results.jsonl
  local name=$1 secs=$2; shift 2
  echo "=== $name (cap ${secs} s): $*"
  local t0=$SECONDS
  timeout "$secs" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "{\"check\": \"$name\", \"exit\": $rc, \"seconds\": $((SECONDS - t0)), \"cpu_smoke\": $([ "$SMOKE" = 1 ] && echo true || echo false)}" >> "$RESULTS"
  echo "=== $name: exit $rc after $((SECONDS - t0)) s"
}
SD35="$OUT/random-sd35"
sd35() {  # the SD3.5-Medium-sized random pipeline, built once for the checks that load it from a directory
  [ -f "$SD35/model_index.json" ] || "$PY" scripts/random_pipeline.py "$SD35" $([ "$SMOKE" = 1 ] && echo --tiny)
}

# ---- the default checks, most wanted first; caps sum to 460 s ----------------------------------
# 1. Sol-RL's exploration: compiled BF16 against compiled FP8 (per-row, no process-wide Inductor tuning), a 6-of-10
#    step preview and First Block Cache, each with its error against BF16 (goal: all together at least 1.6x).
if wanted explore default; then
  run explore 170 "$PY" scripts/bench_explore.py --out "$RESULTS" $([ "$SMOKE" = 1 ] && echo --cpu-smoke)
fi
# 2. A Flow-GRPO iteration of the SD3.5-Medium 1-GPU preset (random weights, one prompt, 8 samples) eager against
#    model.compile blocks (goal: compiled at least 1.3x).
if wanted grpo_compile default; then
  sd35
  if [ "$SMOKE" = 1 ]; then
    size=(--modes none --iterations 2 --warmup 1 model.device=cpu model.height=64 model.width=64 sampling.num_steps=2
          sampling.batch_size=2 data.group_size=2)
  else
    size=(--modes none blocks --iterations 4 --warmup 2 model.device=cuda sampling.batch_size=8 data.group_size=8)
  fi
  run grpo_compile 200 "$PY" scripts/bench_compile.py --config sd35_medium_pickscore_1gpu --out "$RESULTS" "${size[@]}" \
    "model.path=$SD35" data.prompt_file=null "data.prompts=[a red fox in the snow]" data.prompts_per_iteration=1 \
    "reward.weights={brightness: 1.0}" trainer.gradient_accumulation_steps=1 sampling.eval_num_steps=2
fi
# 3. FSDP2 full fine-tuning of the SD3.5-Medium-sized transformer: peak memory against plan_memory.py (goal: within 15%).
if wanted fsdp_memory default; then
  run fsdp_memory 90 "$PY" scripts/bench_fsdp_memory.py --out "$RESULTS" $([ "$SMOKE" = 1 ] && echo --cpu-smoke --iterations 1)
fi

# ---- named only: each wants a device call of its own ----------------------------------------------
# One iteration of each algorithm's 1-GPU preset at its real size with random weights (GRPO, DGPO, NFT and BranchGRPO on
# SD3.5-Medium, G2RPO and GDRO on FLUX.1-dev): seconds per iteration and peak memory against the plan.
if wanted presets named; then
  run presets 560 "$PY" scripts/bench_presets.py --out "$RESULTS" $([ "$SMOKE" = 1 ] && echo --cpu-smoke)
fi
# One Flow-GRPO iteration of Qwen-Image (20B), Z-Image-Turbo (6B) and Wan2.1 (1.3B, 5 frames) at their real sizes with
# random weights: seconds per iteration and peak memory against the plan (`families families_video`: 570 s).
if wanted families named; then
  run families 420 "$PY" scripts/bench_families.py --families qwen_image z_image --out "$RESULTS" $([ "$SMOKE" = 1 ] && echo --cpu-smoke --iterations 1)
fi
if wanted families_video named; then
  run families_video 150 "$PY" scripts/bench_families.py --families wan --out "$RESULTS" $([ "$SMOKE" = 1 ] && echo --cpu-smoke --iterations 1)
fi
# The memory features of issue 68 (AdamW vs 8-bit, bf16 vs NF4 base, text encoders on the device vs cached, all three),
# one Flow-GRPO iteration each at the real transformer size with random weights: peak memory against the plan
# (`memory_features`: SD3.5-Medium, batch 4; `memory_features_flux`: FLUX.1-dev, batch 2).
if wanted memory_features named; then
  run memory_features 300 "$PY" scripts/bench_memory_features.py --model sd35 --out "$RESULTS" $([ "$SMOKE" = 1 ] && echo --cpu-smoke)
fi
if wanted memory_features_flux named; then
  run memory_features_flux 560 "$PY" scripts/bench_memory_features.py --model flux1 --out "$RESULTS" $([ "$SMOKE" = 1 ] && echo --cpu-smoke)
fi
# Two iterations of the Qwen2.5-0.5B GSM8K text preset at its real size with random weights (128 new tokens).
if wanted text_preset named; then
  run text_preset 90 "$PY" scripts/bench_text_preset.py --out "$RESULTS" $([ "$SMOKE" = 1 ] && echo --cpu-smoke)
fi
# Asynchronous rollouts (issue 49): the shapes default synchronous against a producer sharing the card (staleness 1)
# and against two producers sharing it (staleness 2), 2 minutes each at an equal budget (run.cpu_processes is CPU-only,
# so sync2 is one process here).
if wanted async_shapes named; then
  run async_shapes 590 "$PY" scripts/bench_async.py --task shapes --minutes 2 --seeds 0 --parts sync2 async1 async2_producers2 \
    --out "$OUT/async-shapes-gpu.jsonl" --runs /tmp/bench-async
fi
# Ray rollout workers (issue 89): the default preset with the local producer and with one Ray worker, both sharing the
# card (bench_ray; Ray and its dependencies must be importable there: their wheels in .whl/)
if wanted ray named; then
  run ray 420 "$PY" scripts/bench_ray.py --iterations 30 --parts local ray1 $([ "$SMOKE" = 1 ] && echo --smoke)
fi

echo "=== results ($RESULTS)"
cat "$RESULTS"
