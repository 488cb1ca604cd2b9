# Sourced by issue27_longest.sh and issue27_probe.sh: fla over Triton 3.7.1 in /tmp/site (.tw/triton371.tar.xz, see
# issue27_fla.sh), fla's autotune results from an earlier call (.tw/triton_cache_autotune.tar.xz) in the Triton
# cache the processes share, and the allocator's expandable segments.
mkdir -p "$OUT" /tmp/site /tmp/triton_cache
tar -xJf .tw/triton371.tar.xz -C /tmp/site
tar -xJf .tw/triton_cache_autotune.tar.xz -C /tmp/triton_cache
export TRITON_CACHE_DIR=/tmp/triton_cache PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
