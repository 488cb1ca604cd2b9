#!/usr/bin/env bash
# Issue 33 on two GPUs of one host (nvidia-h200-x2), two device calls of at most 10 minutes each:
#
#   bash benchmarks/two_gpu.sh OUT resume   # call 1, ~9 min: the main job at sp 2 on the Qwen3-0.6B shape at 262,144
#       tokens (random weights in a local folder, global batch 2), saved at step 2 of 3; the step-2 checkpoint
#       converted to a universal one on the CPU beside step 3 (time and disk recorded); resumed on 1 GPU through that
#       reshard, then on 2 GPUs at sp 1 x dp 2 (DeepSpeed's own load: the same world size); each resumed step 3's loss
#       (within 1e-3) and update (5e-2) against the uninterrupted run's. Estimate from BENCHMARKS.md (a sequence 29 s at
#       sp 2, 58 s at sp 1): the steps ~6.5 min, launches and saves ~2.5 min: the last phase may meet the budget (it is
#       then recorded as cut; the reshard's resume comes first).
#   bash benchmarks/two_gpu.sh OUT lora8b   # call 2, ~9 min: the Qwen3-8B shape + LoRA r 16 at sp 2, 524,288 tokens,
#       one step (the first): step time and rank 0's peak against the dry run's (within 10%), the plans compared.
#       Estimate: the weights written ~1 min, the job's start and host buffers ~2 min, the step ~5.5 min (the dry run
#       on this CPU predicts 312 s; one GPU took 204 s at 262,144 tokens).
#   bash benchmarks/two_gpu.sh OUT tests    # ~3 min: tests/test_nccl_sp.py (sp 2 against sp 1 over NCCL, every family)
#       and tests/test_nccl_faults.py (a rank SIGKILLed mid-step), their output in OUT/two_gpu_tests.log
#   bash benchmarks/two_gpu.sh OUT all --smoke   # on CPU (gloo, deepspeed --num_gpus 2), a tiny shape: ~2 min
#
# Each part writes OUT/two_gpu_<part>.json (after each phase) and OUT/logs/, and prints a short table last. The whole
# run has --budget-s 570 (the device call's 600 s less the wheels' install): a phase that meets it is cut and
# recorded, the rest skipped. Runs and weights live in a new /tmp/two_gpu_* (not under OUT, whose files come back),
# removed at the end (--keep keeps them). On the lent machine, after
# the usual wheel install (COMMON.md), from the checkout's root:
#   bash benchmarks/two_gpu.sh $OUT/resume resume
set -euo pipefail
out=${1:?output dir}
part=${2:?part: tests, resume, lora8b or all}
shift 2
cd "$(dirname "$0")/.."   # the checkout root
export HF_HUB_OFFLINE=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True NCCL_NVLS_ENABLE=0 \
  TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$out"
if [ "$part" = tests ]; then
  python3 -m pytest tests/test_nccl_sp.py tests/test_nccl_faults.py -q -s -rs "$@" 2>&1 | tee "$out/two_gpu_tests.log" \
    | grep -E "rank [01]|killed|passed|failed|skipped|Error" | tail -n 40
  exit
fi
python3 benchmarks/two_gpu.py "$part" --out "$out" "$@" 2>&1 | tee "$out/two_gpu_$part.log" | tail -n 20
