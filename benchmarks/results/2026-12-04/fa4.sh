#!/bin/bash
# Issue 43 item 1, FlashAttention-4 on one H200: install the wheel set (docs/models.md "FlashAttention-4"), run
# tests/test_fa4.py, then time the kernels (benchmarks/bench_fa4.py) or the main job's step (bench_step.py --suite fa4).
# The cu13 wheel (92 MB) is over a call's 64 MiB, so it travels in two byte ranges over two back-to-back calls:
#   here:   split -b 58000000 -d -a 1 nvidia_cutlass_dsl_libs_cu13-4.8.1-*.whl cu13.part
#           .fa4a/cu13.part0; .fa4/wheels/: cu13.part1 and the other seven wheels (.fa4 and .fa4a in .git/info/exclude)
#   call 1 (carry .fa4a):       mkdir -p /tmp/fa4parts && cp .fa4a/cu13.part0 /tmp/fa4parts/
#   call 2 (carry .fa4, .whl):  bash benchmarks/results/2026-12-04/fa4.sh $OUT smoke,tests,bench    (2026-12-04, 205 s)
#   call 4 (after a call 3 as 1): bash benchmarks/results/2026-12-04/fa4.sh $OUT smoke,tests,steps  (2026-12-04, 360 s)
#   the kernel cache (2026-12-04, later): call 1 as above, then bash benchmarks/results/2026-12-04/fa4.sh $OUT smoke,cache
#   head dim 256 (2026-12-04, later): call 1 as above, then bash benchmarks/results/2026-12-04/fa4.sh $OUT smoke,wide
#   later (issue 43's must-show, ALST in the same call): call 1 as above, then
#           SUITE=fa4alst bash benchmarks/results/2026-12-04/fa4.sh $OUT smoke,steps
#   FA4 SM90 tile configs (2026-12-06, one H100, 123 s): call 1 as above, then bash benchmarks/results/2026-12-04/fa4.sh $OUT smoke,tiles
#   the 4B step with FA4's forward on the 128 x 160 tile against ALST and the default (2026-12-06, one H200, 422 s):
#   call 1 as above, then
#           CALL_S=570 SUITE=fa4fwd bash benchmarks/results/2026-12-04/fa4.sh $OUT smoke,steps
#   the CUDA tests never yet run on a GPU (fused RMSNorm, fused RoPE, FA4 at head dim 256, the offload's per-tensor
#   copy events), then the 4B step with
#   the fused RoPE against the default and ALST: call 1 as above, then
#           SUITE=fa4rope bash benchmarks/results/2026-12-04/fa4.sh $OUT smoke,checks,steps
#   the attention forward in one call (the default since 2026-12-06) against the forward over head groups, and why the
#   step's FA4 backward is slower than alone (bench_fa4_gap.py), then the 4B step both ways: call 1 as above, then
#           CALL_S=580 SUITE=fa4one CHECK_TESTS="tests/test_head_groups.py tests/test_query_head_groups.py
#           tests/test_fa4.py" bash benchmarks/results/2026-12-04/fa4.sh $OUT smoke,checks,gap,steps
#   the next session (issue 43): the CUDA tests of the fused CE rows and the RMSNorm rows kernels, their kernel
#   benchmarks, then the fa4next suite over two calls on one machine:
#           CALL_S=580 SUITE=fa4next ONLY="ours-plan-4B@128k-fa4 ours-plan-4B@128k-fa4-ce-rows-rms
#           ours-plan-4B@128k-fa4-ce-rows-rms-bwd80" CHECK_TESTS="tests/test_chunked_loss.py tests/test_rmsnorm.py
#           tests/test_swiglu.py -k cuda" bash benchmarks/results/2026-12-04/fa4.sh $OUT smoke,checks,kernels,steps
#   then, on the same warm machine: python3 benchmarks/bench_step.py --suite fa4next --only alst-4B@128k ... (the rest)
#   run on 2026-12-07 (one H100, 300 s): CALL_S=375 ONLY="ours-plan-4B@128k-fa4-ce-rows-rms alst-4B@128k" and the same
#   CHECK_TESTS, stages smoke,checks,steps. The fused CE rows are the default since.
#   run on 2026-12-07, later (one H100 again, 485 s + 305 s; BENCHMARKS.md), after which the RMSNorm rows are the
#   default too. The next call, on an H200 (call 1 first; the plain variant has both kernels, -torch-rms and
#   -eager-ce are the A/Bs):
#           CALL_S=580 SUITE=fa4next ONLY="ours-plan-4B@128k-fa4 alst-4B@128k ours-plan-4B@128k-fa4-torch-rms"
#           bash benchmarks/results/2026-12-04/fa4.sh $OUT smoke,steps
#   then on the same warm machine:
#           CALL_S=450 SUITE=fa4next ONLY="ours-plan@256k-fa4-ce-rows-rms alst@256k" bash ... $OUT smoke,steps
#   session 27 (2026-12-07, later), the H200 call with the tiled backward without the down projection's forward:
#           CALL_S=580 SUITE=fa4h200 ONLY="ours-plan-4B@128k-fa4 alst-4B@128k ours-plan-4B@128k-fa4-full-mlp
#           ours-plan-4B@128k-fa4-bwd80" CHECK_TESTS="tests/test_tiled_mlp.py -k cuda" bash ... $OUT smoke,checks,steps
#   then on the same warm machine: CALL_S=450 SUITE=fa4h200 ONLY="ours-plan@256k-fa4 alst@256k" bash ... $OUT smoke,steps
#   not run (2026-12-07, later: no H200 came); the -full-mlp A/B is done (one H100), so the next H200 call is, ~400 s:
#           CALL_S=470 SUITE=fa4h200 ONLY="ours-plan-4B@128k-fa4 alst-4B@128k ours-plan-4B@128k-fa4-bwd80"
#           bash benchmarks/results/2026-12-04/fa4.sh $OUT smoke,steps
#   session 29 (2026-12-07, one H100): today's 4B step profiled (BENCHMARKS.md; CALL_S=235 was too short on a fresh
#   machine, killed inside the variant; 340 gave 210 s on the warm one):
#           BENCH_PROFILE=1 CALL_S=340 SUITE=fa4profile ONLY="ours-plan-4B@128k-fa4" bash ... $OUT smoke,steps
#   the H200 call above is still the next one.
# Records: fa4_kernels.json / .log, fa4_steps.json / .txt / .log, fa4_tests_call1.log / call2.log.
set -u
OUT=$1; STAGES=${2:-smoke,tests,bench}
T0=$(date +%s); rm -f /tmp/fa4_smoke_ok
W=nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
if [ ! -f /tmp/fa4parts/cu13.part0 ]; then echo "no /tmp/fa4parts/cu13.part0: run call 1 first, back to back"; exit 3; fi
cat /tmp/fa4parts/cu13.part0 .fa4/wheels/cu13.part1 > /tmp/fa4parts/$W
echo "50191a381d8cc1393373ae0bc879b0aefa9a256c23c22d4fa1c2fe3dfe57bc90  /tmp/fa4parts/$W" | sha256sum -c - || exit 4
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fa4site \
  /tmp/fa4parts/$W .fa4/wheels/*.whl .whl/*.whl 2>&1 | grep -v "WARNING: Target directory" | tail -3
# pip --target never runs nvidia_cutlass_dsl_packages.pth, which puts dsl_packages (the `cutlass` package) on sys.path
export PYTHONPATH=/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1
if [[ $STAGES == *smoke* ]]; then
timeout 240 python3 - <<'PY' 2>&1 | grep -v -E "Warning|exe_args"
import time, torch
t = time.time()
import cutlass.cute, flash_attn.cute.interface  # noqa: F401
print(f"cutlass.cute and flash_attn.cute import in {time.time() - t:.1f}s")
from ulysses_lc.mixers.kernels import causal_attention
q = torch.randn(1, 4, 1024, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k, v = (torch.randn(1, 2, 1024, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
out = causal_attention(q, k, v, None, "fa4")
out.sum().backward()
ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
err = ((out.float() - ref).norm() / ref.norm()).item()
print("rel err", err)
if err < 2e-2:
    open("/tmp/fa4_smoke_ok", "w").write("ok")
PY
fi
[ -f /tmp/fa4_smoke_ok ] || { echo "smoke failed: no tests, no timing"; exit 5; }
if [[ $STAGES == *tests* ]]; then
timeout 300 python3 -m pytest -q -rs tests/test_fa4.py 2>&1 | tee $OUT/tests.log | tail -5
fi
if [[ $STAGES == *checks* ]]; then  # the CUDA tests of kernels that changed since a GPU last ran them
timeout 240 python3 -m pytest -q -rs ${CHECK_TESTS:-tests/test_rope.py tests/test_rmsnorm.py tests/test_fa4.py \
  tests/test_offload.py tests/test_kept_attention.py -k "cuda or 256"} 2>&1 | tee $OUT/checks.log | tail -6
fi
if [[ $STAGES == *kernels* ]]; then  # the levers' Triton kernels alone: RMSNorm's rows, the loss head's fused rows
timeout 150 python3 benchmarks/bench_rmsnorm.py --out $OUT 2>&1 | grep -v Warning | tee $OUT/rmsnorm.log | tail -12
timeout 120 python3 benchmarks/bench_loss.py --tokens 131072 --hidden 2560 --variants ours ours-fused --out $OUT 2>&1 \
  | grep -v Warning | tee $OUT/loss.log | tail -6
fi
if [[ $STAGES == *gap* ]]; then  # FA4's backward in the step against alone; the forward in one call (bench_fa4_gap.py)
timeout 240 python3 benchmarks/bench_fa4_gap.py --out $OUT --sustain-s ${SUSTAIN_S:-20} 2>&1 | grep -v -E "Warning|exe_args" \
  | tee $OUT/gap.log | tail -16
fi
if [[ $STAGES == *cache* ]]; then  # the kernel cache (--kernel-cache): FA4's compile in a fresh process, then in one
# that finds what the first left (kernel_cache.cache_environment sets FLASH_ATTENTION_CUTE_DSL_CACHE_DIR / _ENABLED)
for proc in fresh cached; do
timeout 120 python3 - $proc <<'PY' 2>&1 | grep -v -E "Warning|exe_args" | tee -a $OUT/fa4_cache.log
import sys, time
from pathlib import Path
import torch
from ulysses_lc.train.kernel_cache import cache_environment
with cache_environment(Path("/tmp/fa4_kernel_cache")):
    from ulysses_lc.mixers.kernels import causal_attention
    times = []
    for _ in range(2):
        q = torch.randn(1, 16, 8192, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(1, 8, 8192, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        torch.cuda.synchronize(); t = time.time()
        causal_attention(q, k, v, None, "fa4").sum().backward()
        torch.cuda.synchronize(); times.append(time.time() - t)
files = list(Path("/tmp/fa4_kernel_cache/fa4").rglob("*"))
print(f"{sys.argv[1]}: first fwd+bwd {times[0]:.2f} s, second {times[1]:.3f} s; fa4/ holds {len(files)} files")
PY
done
fi
LEFT=$(( ${CALL_S:-585} - ($(date +%s) - T0) ))
if [[ $STAGES == *tiles* ]]; then  # FA4's SM90 launch configs against its default (benchmarks/bench_fa4_tiles.py)
timeout $LEFT python3 benchmarks/bench_fa4_tiles.py --out $OUT --budget-s $(( LEFT - 45 )) \
  --shapes ${TILE_SHAPES:-4b-all,4b,0.6b} 2>&1 | grep -v Warning | tee $OUT/tiles.log | tail -45
LEFT=$(( ${CALL_S:-585} - ($(date +%s) - T0) ))
fi
if [[ $STAGES == *wide* ]]; then  # head dim 256 (Qwen3.5's full layers), FA4 against cuDNN, full causal only
timeout $LEFT python3 benchmarks/bench_fa4.py --only full --full-shapes qwen3.5-0.8b --out $OUT \
  --budget-s $(( LEFT - 30 )) 2>&1 | grep -v Warning | tee $OUT/bench_wide.log | tail -4
fi
if [[ $STAGES == *bench* ]]; then
timeout $LEFT python3 benchmarks/bench_fa4.py --out $OUT --budget-s $(( LEFT - 75 )) 2>&1 | grep -v Warning \
  | tee $OUT/bench.log | tail -20
fi
if [[ $STAGES == *steps* ]]; then
timeout $LEFT python3 benchmarks/bench_step.py --suite ${SUITE:-fa4} ${ONLY:+--only $ONLY} --out $OUT --budget-s $(( LEFT - 10 )) 2>&1 | grep -v Warning \
  | tail -8
fi
