#!/usr/bin/env bash
# The project's pending GPU measurements, run as one command on a CUDA machine.
#
# Each line below is a benchmark whose GPU number BENCHMARKS.md still lacks; delete a line once
# its result is recorded there. Logs go to $OUT (or ./gpu_checks_out) so they come back even when
# a later check runs out of time.
#
# The GPU machine has torch, transformers, accelerate and peft, but not diffusers, torchao or
# omegaconf: put their wheels in .whl/ first (python 3.12, manylinux x86_64), e.g.
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform any -d .whl diffusers==0.42.1 torchao==0.18.0 omegaconf==2.4.0
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_checks_out}"
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/machine.txt"
python3 -c "import torch, diffusers; print('torch', torch.__version__, 'diffusers', diffusers.__version__)" | tee -a "$OUT/machine.txt"

CHECKS=("$@")  # names to run (scripts/gpu_checks.sh families); none: every check
run() {  # run NAME SECONDS CMD...: one check, its log in $OUT/NAME.log, stopped after SECONDS
  local name=$1 secs=$2; shift 2
  if [ ${#CHECKS[@]} -gt 0 ] && [[ ! " ${CHECKS[*]} " == *" $name "* ]]; then return; fi
  echo "=== $name: $*"
  timeout "$secs" "$@" 2>&1 | tee "$OUT/$name.log"
  echo "=== $name: exit ${PIPESTATUS[0]}"
}

# Each check is capped; fsdp_memory and two_stage_compile together end within 9.5 minutes on an H100
# or H200, families needs a call of its own (one device call runs at most 10 minutes).
# FSDP2 smoke run: full fine-tuning of an SD3.5-Medium-sized transformer on one GPU under
# run.distributed=fsdp2, peak memory against scripts/plan_memory.py's estimate (goal: within 15%).
run fsdp_memory 240 python3 scripts/bench_fsdp_memory.py
# FP8 vs BF16 exploration throughput with torch.compile (eager 0.72x; goal 1.6x). A whole-model compile
# of the 2.24B-parameter transformer did not finish both copies in 380 s (2026-11-26), so the bench
# compiles per transformer block (regional compilation); the log keeps whatever finished.
run two_stage_compile 330 python3 scripts/bench_two_stage.py --gpu --fidelity-prompts 0 --compile
# One Flow-GRPO iteration of Qwen-Image (20B), Z-Image-Turbo (6B) and Wan2.1 (1.3B, 5 frames) at their
# real sizes with random weights (LoRA r64, 512x512, batch 1): seconds per iteration and peak memory
# against the plan; `scripts/gpu_checks.sh families families_video` fits one device call (570 s at most).
run families 420 python3 scripts/bench_families.py --families qwen_image z_image
run families_video 150 python3 scripts/bench_families.py --families wan
# Asynchronous rollouts on one GPU (issue 49): the shapes default synchronous against a producer sharing the
# card (staleness 1), 2 minutes each at an equal budget (run.cpu_processes is CPU-only, so sync2 is one process here).
run async_shapes 420 python3 scripts/bench_async.py --task shapes --minutes 2 --seeds 0 --parts sync2 async1 \
  --out "$OUT/async-shapes-gpu.jsonl" --runs /tmp/bench-async
