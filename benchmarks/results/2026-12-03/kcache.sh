#!/bin/bash
# Issue 43 items 2 and 3 on one H200, one device call per PART (each under 10 minutes):
#   fresh    fla-core 0.6.0 over Triton 3.7.1, the Qwen3.5-0.8B shape (24 layers) at 262,144 tokens, twice: first
#            in a process on an empty kernel cache (a fresh machine: the 8k warm-up pays fla's autotuning, about
#            170 s), then in a second process on the cache the first filled (a machine that ran it before). The
#            cache is set as --kernel-cache sets it (TRITON_CACHE_DIR and TORCHINDUCTOR_CACHE_DIR into its triton/ and
#            inductor/). Returns $OUT/kernel_cache.tar.xz: carry it back as .tw/kernel_cache.tar.xz for `carried`.
#   carried  the same step on a fresh machine given that cache (another node reading a shared folder).
#   torch    the image's Triton 3.6.0, on which fla refuses its gated backward (the torch path): 24 and 8 layers
#            at 131,072 tokens, each with the plan plan_step makes and the dry run's predicted step time, to refit
#            deltanet_time.TORCH_*_S_PER_TOKEN (issue 43: 49 s measured, 88.9 s predicted, for 24 layers at 128k;
#            the records of that run are not in the repository).
# Each step's record (bench_hybrid.py's JSON): first_warmup_s (the 8k warm-up, on fla the autotuning),
# first_step_s (the first step at the length), step_s (the steady step), predicted_step_s_flops, plan.
#   bash benchmarks/results/2026-12-03/kcache.sh $OUT PART   (after .whl/*.whl are installed into /tmp/site;
#   carry .whl, and for fresh / carried .tw/triton371.tar.xz, for carried .tw/kernel_cache.tar.xz)
#   ARCHIVE=0: no kernel_cache.tar.xz (its xz takes a minute of the call). LEN / NAME / T1 / T2 (defaults 262144 / 256k / 330 / 200): the length, its label, and the two steps' time limits
#   (2026-12-04, the device time left that session: LEN=8192 NAME=8k T1=190 T2=60. The first process on an empty
#   cache was still autotuning at 190 s, 2,082 files / 113 MB in the cache by then; the second, on that cache, still at
#   60 s: no step finished, so no figure. The Triton tarball was cut to the NVIDIA backend (backends/amd removed, which
#   needs its entry point removed too, below: Triton imports every backend its dist-info names).)
set -u
OUT=$1
PART=${2:-fresh}
LEN=${LEN:-262144}; NAME=${NAME:-256k}; T1=${T1:-330}; T2=${T2:-200}
mkdir -p "$OUT"
KC=/tmp/kernel_cache
export TRITON_CACHE_DIR=$KC/triton TORCHINDUCTOR_CACHE_DIR=$KC/inductor
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1
step() {  # NAME LAYERS LENGTH LABEL SECONDS: one ours phase of bench_hybrid at one length
  timeout "$5" python3 benchmarks/bench_hybrid.py --phase ours --child-out "$OUT/$1.json" \
    --deadline $(( $(date +%s) + $5 - 10 )) --shape qwen3.5-0.8b --layers "$2" --lengths "$3" --names "$4" \
    2>&1 | grep -v Warning > "$OUT/$1.log"
  python3 - "$OUT/$1.json" "$4" <<'PY'
import json, sys
rec = json.load(open(sys.argv[1]))
at = rec.get(sys.argv[2], {})
print(sys.argv[1].rsplit("/", 1)[-1], rec.get("deltanet", "")[:60], "| 8k warm-up", rec.get("first_warmup_s"),
      "| first", at.get("first_step_s"), "| steady", at.get("step_s"), "| predicted", at.get("predicted_step_s_flops"),
      "| plan", at.get("plan"), "|", at.get("status"))
PY
}
case $PART in
  fresh|carried)
    mkdir -p /tmp/site "$KC"
    tar -xJf .tw/triton371.tar.xz -C /tmp/site
    sed -i /amd/d /tmp/site/triton-*.dist-info/entry_points.txt  # a tarball cut to the NVIDIA backend
    if [ "$PART" = carried ]; then tar -xJf .tw/kernel_cache.tar.xz -C "$KC"; fi
    step "fla_${PART}_1" 24 "$LEN" "$NAME" "$T1"
    [ "$PART" = fresh ] && step fla_fresh_2 24 "$LEN" "$NAME" "$T2"
    (cd "$KC" && find . -type f | wc -l && du -sh .) | tee "$OUT/kernel_cache_size.txt"
    [ "$PART" = fresh ] && [ "${ARCHIVE:-1}" = 1 ] && tar -cJf "$OUT/kernel_cache.tar.xz" -C "$KC" . && ls -la "$OUT/kernel_cache.tar.xz"
    ;;
  torch)
    step torch_24layers_128k 24 131072 128k 330
    step torch_8layers_128k 8 131072 128k 200
    ;;
esac
