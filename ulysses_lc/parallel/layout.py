"""Process-group layout: which ranks share one sequence (SP axis) and which see different data (DP axis).

Placement across nodes (`placement`, default "node"): the ranks are put in node order (each node's ranks
together, nodes by their lowest global rank, whatever order the launcher numbered them in: SLURM's cyclic
distribution interleaves nodes), and sequence-parallel group i is the i-th run of sp_size ranks in that order.
So the all-to-all around attention, which carries every activation of every layer, stays inside a node (NVLink)
whenever sp_size divides the GPUs per node; data parallelism, whose only traffic is ZeRO-3's, runs across nodes.
Where sp_size exceeds the GPUs per node, each SP group spans whole consecutive nodes. "across" reverses the two
axes (SP group i takes every dp_size-th rank of the node order: SP over the nodes, DP inside each), for a
user who wants it; `ParallelLayout.placement_line` states which one a run has. Data-parallel group j holds
SP rank j of every SP group. Nodes are told apart by host name and the launcher's node index
(`distributed.node_id`), so simulated nodes on one machine are two nodes.

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

from collections import Counter
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

PLACEMENTS = ("node", "across")


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
    nodes: tuple[int, ...] | None = None  # node index of every global rank (None: one node)
    placement: str = "node"
    sp_groups: tuple[tuple[int, ...], ...] | None = field(default=None, repr=False)  # None: from nodes and placement

    def __post_init__(self):
        if self.sp_size < 1:
            raise ValueError(f"sp_size must be >= 1, got {self.sp_size}.")
        if self.world_size % self.sp_size:
            raise ValueError(
                f"world size {self.world_size} is not divisible by sp_size={self.sp_size}; "
                f"pick sp_size in {_divisors(self.world_size)} or launch a multiple of {self.sp_size} ranks."
            )
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement {self.placement!r}: pick one of {', '.join(PLACEMENTS)} (node: SP groups "
                             "inside a node, DP across nodes; across: the reverse).")
        if self.nodes is not None and len(self.nodes) != self.world_size:
            raise ValueError(f"nodes names {len(self.nodes)} ranks' nodes for a world of {self.world_size}.")
        if self.sp_groups is None:
            object.__setattr__(self, "sp_groups", sp_group_ranks(self.world_size, self.sp_size, self.nodes, self.placement))

    @classmethod
    def build(cls, sp_size: int | None = None, placement: str = "node") -> "ParallelLayout":
        """Create the SP and DP groups for the current process group (sp_size defaults to the world size).

        Collective: every rank's node (`distributed.node_id`) is gathered first, then every group is created on
        every rank in the same order. placement: "node" (SP inside a node) or "across" (see the module's notes)."""
        if not dist.is_initialized():
            raise ValueError(
                "torch.distributed is not initialised; call deepspeed.init_distributed() (or "
                "torch.distributed.init_process_group) before ParallelLayout.build()."
            )
        from .distributed import bind_cuda_device, node_id, number_nodes

        world, rank = dist.get_world_size(), dist.get_rank()
        bind_cuda_device()  # the node ids travel by an object collective, on the current device under NCCL
        sp_size = world if sp_size is None else sp_size
        cls(world, sp_size, placement=placement)  # validate before any collective
        ids = [None] * world
        dist.all_gather_object(ids, node_id())
        nodes = number_nodes(ids)
        plain = cls(world, sp_size, rank, nodes=nodes, placement=placement)
        sp_group = dp_group = None
        # new_group is collective: every rank creates every group, keeps its own.
        for ranks in plain.sp_groups:
            group = dist.new_group(list(ranks))
            if rank in ranks:
                sp_group = group
        for ranks in plain.dp_groups:
            group = dist.new_group(list(ranks))
            if rank in ranks:
                dp_group = group
        world_group = dist.new_group(list(range(world)))
        return replace(plain, sp_group=sp_group, dp_group=dp_group, world_group=world_group)

    def without_groups(self) -> "ParallelLayout":
        """The same ranks and positions without process groups (picklable, for worker processes)."""
        return replace(self, sp_group=None, dp_group=None, world_group=None)

    @property
    def dp_size(self) -> int:
        return self.world_size // self.sp_size

    @property
    def dp_groups(self) -> tuple[tuple[int, ...], ...]:
        """Global ranks of each DP group: group j holds SP rank j of every SP group."""
        return tuple(tuple(group[j] for group in self.sp_groups) for j in range(self.sp_size))

    def _position(self) -> tuple[int, int]:
        for i, group in enumerate(self.sp_groups):
            if self.rank in group:
                return i, group.index(self.rank)
        raise ValueError(f"rank {self.rank} is in no SP group of a world of {self.world_size}.")

    @property
    def sp_rank(self) -> int:
        """This rank's place in its SP group (which slice of the sequence it holds)."""
        return self._position()[1]

    @property
    def dp_rank(self) -> int:
        """This rank's SP group: which sequence of the step it trains."""
        return self._position()[0]

    @property
    def num_nodes(self) -> int:
        return 1 if self.nodes is None else len(set(self.nodes))

    def ranks_on_node(self, rank: int | None = None) -> int:
        """Ranks on `rank`'s node (default this rank's): those sharing its host memory."""
        if self.nodes is None:
            return self.world_size
        return self.nodes.count(self.nodes[self.rank if rank is None else rank])

    @property
    def sp_group_nodes(self) -> int:
        """The most nodes one SP group spans (1: every all-to-all stays inside a node)."""
        if self.nodes is None:
            return 1
        return max(len({self.nodes[r] for r in group}) for group in self.sp_groups)

    def placement_line(self) -> str:
        """Where the SP groups sit, for the start-up block and the dry run."""
        if self.nodes is None or self.num_nodes == 1:
            return f"1 node: every SP group of {self.sp_size} inside it"
        per_node = Counter(self.nodes)
        counts = sorted(set(per_node.values()))
        ranks = (f"{counts[0]} rank{'s' if counts[0] > 1 else ''}" if len(counts) == 1
                 else f"{counts[0]}-{counts[-1]} ranks")
        head = f"{self.num_nodes} nodes x {ranks}"
        spans = self.sp_group_nodes
        if spans == 1:
            where = "DP across nodes" if self.dp_size > 1 else "one sequence"
            return (f"{head}: each SP group of {self.sp_size} inside one node (the all-to-all stays on the node's "
                    f"links), {where} (--sp-placement {self.placement})")
        why = (f"sp {self.sp_size} > {max(counts)} ranks per node" if self.sp_size > max(counts)
               else f"--sp-placement {self.placement}" if self.placement != "node"
               else f"sp {self.sp_size} does not divide {min(counts)} ranks per node")
        return (f"{head}: SP groups span up to {spans} nodes, so the all-to-all crosses the network ({why})")

    @property
    def mpu(self) -> "DeepSpeedMPU":
        """The object `deepspeed.initialize(mpu=...)` expects for sequence parallelism."""
        return DeepSpeedMPU(self)


def sp_group_ranks(world_size: int, sp_size: int, nodes=None, placement: str = "node") -> tuple[tuple[int, ...], ...]:
    """Global ranks of each SP group, in SP order, for ranks on `nodes` (node index per rank; None: one node)."""
    order = list(range(world_size)) if nodes is None else sorted(range(world_size), key=lambda r: (nodes[r], r))
    dp_size = world_size // sp_size
    if placement == "across":
        return tuple(tuple(order[i::dp_size]) for i in range(dp_size))
    return tuple(tuple(order[i * sp_size:(i + 1) * sp_size]) for i in range(dp_size))


def nodes_of(world_size: int, ranks_per_node: int) -> tuple[int, ...]:
    """The node of each rank where a launcher numbers each node's ranks together (torchrun, deepspeed, srun's
    block distribution): for a plan made before any launch (the dry run)."""
    return tuple(r // ranks_per_node for r in range(world_size))


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


def dp_sum(counts: list, layout: ParallelLayout) -> list[int]:
    """Counts of the step (labels trained, documents, padding) over all DP groups, in one all-reduce (each SP group
    holds its own sequences' counts)."""
    device = next(c for c in counts if isinstance(c, torch.Tensor)).device
    total = torch.stack([torch.as_tensor(c, device=device, dtype=torch.int64) for c in counts])
    if layout.dp_size > 1:
        dist.all_reduce(total, group=layout.dp_group)
    return total.tolist()


def dp_mean(loss: torch.Tensor, layout: ParallelLayout) -> float:
    """The step's loss averaged over DP groups (each SP group holds the same value on its ranks)."""
    if layout.dp_size > 1:
        loss = loss.clone()
        dist.all_reduce(loss, group=layout.dp_group)
        loss /= layout.dp_size
    return float(loss)
