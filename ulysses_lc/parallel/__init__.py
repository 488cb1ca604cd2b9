"""Parallelism: process groups, where each token and each shard lives, and the all-to-all between them.

distributed (one process-group start for every launcher), layout (ParallelLayout: SP x DP groups, the mpu),
sharding (one sequence shifted, padded and sliced per rank), exchange (the all-to-alls around the mixers),
zero_reshard (ZeRO-3 state onto another world size), ds_config (DeepSpeed config checks).
Imports: the ground modules of ulysses_lc (constants, handle, layers, shape, recompute, tiny, peft_support) only.
"""
