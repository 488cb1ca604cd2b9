"""Process-group layout: which ranks share one sequence (SP axis) and which see different data (DP axis).

Ranks are laid out SP-major: ranks [i*sp, (i+1)*sp) form sequence-parallel group i, so the all-to-all
around attention stays inside a node whenever sp_size divides the GPUs per node. Data-parallel group j
holds rank j of every SP group.

Gradient contract with DeepSpeed ZeRO-3: parameters, gradients and optimizer state are partitioned over
*all* ranks (DeepSpeed's "sequence-data-parallel" group), and ZeRO-3's reduce-scatter averages gradients
over all sp_size * dp_size ranks. The loss on each rank is the whole sequence's mean
(`loss.sp_mean_loss`), whose backward hands every rank sp_size times its own tokens' share of the
gradient; the average over all ranks then equals the sum over the SP group and the mean over DP, which is
the gradient of the per-sequence mean loss averaged over sequences. `reduce_gradients` does the same
for a plain PyTorch loop, and `check_deepspeed_config` refuses DeepSpeed settings whose reduction
divides differently (ZeRO stages 0-2 and ZeRO-3 without reduce-scatter divide by dp_size only, measured
on DeepSpeed 0.19).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def valid_sp_sizes(num_attention_heads: int, num_key_value_heads: int, world_size: int | None = None) -> list[int]:
    """SP degrees the attention exchange can split these heads over (KV heads may be replicated)."""
    sizes = [
        sp
        for sp in _divisors(num_attention_heads)
        if num_key_value_heads % sp == 0 or sp % num_key_value_heads == 0
    ]
    if world_size is not None:
        sizes = [sp for sp in sizes if world_size % sp == 0]
    return sizes


def check_heads(num_attention_heads: int, num_key_value_heads: int, sp_size: int) -> None:
    """Raise ValueError unless the attention heads can be split over sp_size ranks."""
    if num_attention_heads % num_key_value_heads:
        raise ValueError(
            f"num_attention_heads={num_attention_heads} is not a multiple of num_key_value_heads="
            f"{num_key_value_heads}; this is not a valid grouped-query attention config."
        )
    ok = num_attention_heads % sp_size == 0 and (
        num_key_value_heads % sp_size == 0 or sp_size % num_key_value_heads == 0
    )
    if not ok:
        raise ValueError(
            f"sp_size={sp_size} cannot split num_attention_heads={num_attention_heads} / "
            f"num_key_value_heads={num_key_value_heads}: each rank needs a whole number of query heads and "
            f"either a whole number of KV heads or one replicated KV head; "
            f"pick sp_size in {valid_sp_sizes(num_attention_heads, num_key_value_heads)}."
        )


@dataclass(frozen=True)
class ParallelLayout:
    """World size split into sp_size (ranks sharing one sequence) x dp_size (ranks with different sequences).

    Build it after `torch.distributed.init_process_group` (or `deepspeed.init_distributed`) with
    `ParallelLayout.build(sp_size)`; every rank must call it (group creation is collective).
    Pass `layout.mpu` to `deepspeed.initialize(mpu=...)`.
    """

    world_size: int
    sp_size: int
    rank: int = 0
    sp_group: object = field(default=None, repr=False, compare=False)
    dp_group: object = field(default=None, repr=False, compare=False)
    world_group: object = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if self.sp_size < 1:
            raise ValueError(f"sp_size must be >= 1, got {self.sp_size}.")
        if self.world_size % self.sp_size:
            raise ValueError(
                f"world size {self.world_size} is not divisible by sp_size={self.sp_size}; "
                f"pick sp_size in {_divisors(self.world_size)} or launch a multiple of {self.sp_size} ranks."
            )

    @classmethod
    def build(cls, sp_size: int | None = None) -> "ParallelLayout":
        """Create the SP and DP groups for the current process group (sp_size defaults to the world size)."""
        if not dist.is_initialized():
            raise ValueError(
                "torch.distributed is not initialised; call deepspeed.init_distributed() (or "
                "torch.distributed.init_process_group) before ParallelLayout.build()."
            )
        world, rank = dist.get_world_size(), dist.get_rank()
        sp_size = world if sp_size is None else sp_size
        cls(world, sp_size)  # validate before creating any group
        dp_size = world // sp_size
        sp_group = dp_group = None
        # new_group is collective: every rank creates every group, keeps its own.
        for i in range(dp_size):
            ranks = list(range(i * sp_size, (i + 1) * sp_size))
            group = dist.new_group(ranks)
            if rank in ranks:
                sp_group = group
        for j in range(sp_size):
            ranks = list(range(j, world, sp_size))
            group = dist.new_group(ranks)
            if rank in ranks:
                dp_group = group
        world_group = dist.new_group(list(range(world)))
        return cls(world, sp_size, rank, sp_group, dp_group, world_group)

    @property
    def dp_size(self) -> int:
        return self.world_size // self.sp_size

    @property
    def sp_rank(self) -> int:
        return self.rank % self.sp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.sp_size

    @property
    def mpu(self) -> "DeepSpeedMPU":
        """The object `deepspeed.initialize(mpu=...)` expects for sequence parallelism."""
        return DeepSpeedMPU(self)


def reduce_gradients(parameters, layout: "ParallelLayout") -> None:
    """Average gradients over all ranks in place, as ZeRO-3 does (see the gradient contract above).

    For loops without DeepSpeed; under `deepspeed.initialize(mpu=layout.mpu)` the engine does this.
    """
    for p in parameters:
        if p.grad is not None:
            dist.all_reduce(p.grad, group=layout.world_group)
            p.grad.div_(layout.world_size)


class DeepSpeedMPU:
    """Adapter exposing a ParallelLayout through DeepSpeed's sequence-parallel mpu interface.

    DeepSpeed recognises a sequence-parallel mpu by its `initialize_sequence_parallel` attribute (as in
    `deepspeed.runtime.sequence_parallel.parallel_state_sp`): it then partitions ZeRO state over the
    sequence-data-parallel group (here: all ranks) and does not treat SP ranks as tensor-parallel shards
    when computing gradient norms or naming checkpoints.

    It deliberately has no `get_data_parallel_group`: DeepSpeed's ZeRO-3 parameter partitioning would take
    that group (the DP axis only) while its optimizer partitions over all ranks, and the two disagree
    (measured on DeepSpeed 0.19: wrong gradients at sp 2). The DP group stays on the layout (`layout.dp_group`); the DP size
    and rank below are what DeepSpeed uses for batch-size bookkeeping.
    """

    def __init__(self, layout: ParallelLayout):
        self.layout = layout

    def initialize_sequence_parallel(self, sequence_parallel_size: int) -> None:
        if sequence_parallel_size != self.layout.sp_size:
            raise ValueError(
                f"the layout was built with sp_size={self.layout.sp_size}, not {sequence_parallel_size}; "
                "build a new ParallelLayout instead."
            )

    def get_sequence_parallel_group(self):
        return self.layout.sp_group

    def get_sequence_parallel_world_size(self) -> int:
        return self.layout.sp_size

    def get_sequence_parallel_rank(self) -> int:
        return self.layout.sp_rank

    def get_sequence_data_parallel_group(self):
        return self.layout.world_group

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.layout.world_size

    def get_sequence_data_parallel_rank(self) -> int:
        return self.layout.rank

    def get_data_parallel_world_size(self) -> int:
        return self.layout.dp_size

    def get_data_parallel_rank(self) -> int:
        return self.layout.dp_rank

    # No tensor or pipeline parallelism: the model-parallel axis is trivial.
    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0

    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank
