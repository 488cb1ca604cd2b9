"""The memory and speed levers, each an install_* (or a loading call) with a Handle that undoes it.

chunked_loss (no [tokens x vocab] logits; ce_rows and ce_kernel: a chunk's softmax as one Triton kernel),
checkpointing (per-layer checkpoints, CPU offload), host_pool (pinned host buffers and their side-stream round trip),
tiled_mlp (the MLP over sequence tiles; swiglu and swiglu_kernel: a gated-SiLU MLP tile's silu(gate) * up as one
Triton kernel each way), rmsnorm (RMSNorm keeping its bf16 input), rope and rope_kernel (RoPE as one Triton kernel each
way), yarn (RoPE scaling in the config before weights load); triton_support (where those kernels run).
Imports: parallel and the ground modules; never mixers.
"""
