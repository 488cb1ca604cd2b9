"""What runs on the whole sequence after the exchange: attention and the linear-attention layers.

attention (UlyssesAttention: exchange + kernel, installed into a HF model), kernels (causal kernels: SDPA, flash-attn,
per document), explicit_attention (SDPA's forward/backward ops called directly: kept outputs, head groups), fa4
(FlashAttention-4's forward/backward ops: causal, window, sinks, documents), window_attention (sliding windows and sinks, exact), linear_attention (gated DeltaNet: conv and recurrence whole),
fallbacks (which kernel errors mean "no kernel for these inputs", and each fallback taken).
Imports: parallel and the ground modules; never levers (the two meet in model.py and plan).
"""
