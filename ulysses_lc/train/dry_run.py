"""--dry-run: every check, the memory plan, the predicted memory per rank and step time, from the model config alone;
with --max-seq-len, the longest sequence that fits.

Loads no weights, starts no process group and touches no GPU, so a user sizes a 1M-token run on a laptop
before renting the GPUs: `python examples/train_1m.py --dry-run --model Qwen/Qwen3-8B --world-size 8`. A plan that
does not fit raises DoesNotFit (the command exits 1) saying what is over, by how much, and what would fit.
"""

from __future__ import annotations

from dataclasses import replace

from ..parallel.distributed import world_size
from ..plan.first_step import kernel_kinds
from ..parallel.layout import ParallelLayout, nodes_of
from .checkpoint_files import human_bytes
from .config import TrainConfig
from .console import layout_line, startup_block
from .estimate import DoesNotFit, estimate_memory, job_for, limits_for, local_ranks, node_line, sized_params
from .kernel_cache import cache_vars, cached, kernel_keys, kernels_line
from .preflight import preflight
from .settings import RunSettings


def dry_run(cfg: TrainConfig) -> str:
    """Every check, the memory plan, the predicted GPU and host memory per rank and step time, as text; loads no
    weights, starts no process group and allocates nothing on a GPU (it reads the GPU's size where it has one).
    World size: cfg.world_size, else this launch's. Limits per rank (estimate.limits_for): cfg.gpu_memory_gb and cfg.host_memory_gb, else this machine's where it has the
    node's GPUs (local ranks: cfg.gpus_per_node, else the launcher's count, else the world size up to 8), else an
    H200's and a GPU node's stated share. The plan is the one the run computes for the same limits (Job.plan). The
    SP groups' placement (inside a node or across) follows cfg.gpus_per_node and cfg.sp_placement. cfg.max_seq_len:
    plan at the longest sequence that fits instead of cfg.seq_len. DoesNotFit (a CheckFailed) when the plan does
    not fit; its `report` is the text this would have returned."""
    run = RunSettings(cfg)
    ranks = run.plan.world_size or world_size()
    checked = preflight(run, ranks)
    num_params = sized_params(checked)
    # Nodes as a launcher numbers them (each node's ranks together): where the SP groups will sit.
    per_node = local_ranks(checked.world_size, run.plan.gpus_per_node)
    job = job_for(run, checked, num_params, per_node)
    limits, limits_line = limits_for(run.plan, checked.world_size)
    longest_line = None
    if run.plan.max_seq_len:
        longest = job.longest(limits)
        if not longest:
            shortest = job.fit(1024 * checked.sp_size, limits)
            raise DoesNotFit(f"no sequence fits {limits_line}: at {shortest.seq_len:,} tokens it "
                                f"{shortest.verdict()}", job.alternatives(shortest.seq_len, limits), "")
        over = job.fit(int(longest * 1.1), limits)
        longest_line = (f"longest   {longest:,} tokens fit (multiples of {1024 * checked.sp_size:,}); 1.1x that, "
                        f"{over.seq_len:,}: {over.verdict()}")
        run = RunSettings(replace(run.flags, seq_len=longest))
        checked = preflight(run, ranks)  # the YaRN factor of the new length
    seq_len = run.stream.seq_len
    plan = job.plan(seq_len, limits).with_overrides(*run.plan.overrides)
    # What the first step tunes or compiles on the GPUs, and what of it an earlier run left in the kernel cache there.
    folder = run.output.kernel_cache
    keys = kernel_keys(kernel_kinds(job.shape, job.deltanet_path, seq_len, job.kernel), job.shape, seq_len,
                      checked.sp_size)
    found = cached(folder, keys, gpu=None)
    estimate = estimate_memory(run, checked, plan, num_params, limits, per_node,
                               uncached=tuple(kind for kind in keys if kind not in found))
    layout = ParallelLayout(checked.world_size, checked.sp_size, nodes=nodes_of(checked.world_size, per_node),
                            placement=run.parallel.placement)
    block = startup_block(out=None, run=run, checked=checked, layout_line=layout_line(layout, checked.global_batch),
                          num_params=num_params, kernel=run.model.kernel, plan=plan, estimate=estimate, device="gpu",
                          limits_line=limits_line, node=node_line(estimate, per_node),
                          kernels=kernels_line(folder, keys, found, cache_vars(folder)))
    text = "\n".join([block] + ([f"  config    {checked.config_note}"] if checked.config_note else [])
                     + ([f"  {longest_line}"] if longest_line else [])
                     + [f"  {checkpoint_line(run.output.keep_checkpoints, checked, num_params)}", "  nothing was loaded"])
    if not estimate.fit.fits:
        raise DoesNotFit(estimate.fit.verdict(), job.alternatives(seq_len, limits), text)
    return text


CHECKPOINT_BYTES_PER_PARAM = 12  # fp32 weights and Adam's two fp32 moments of each trained parameter (ZeRO-3's files)


def checkpoint_line(keep: int, checked, num_params: int) -> str:
    """How much disk a checkpoint takes: in all, per rank, and with `keep` of them kept (--keep-checkpoints)."""
    trained = checked.trainable_params if checked.trainable_params is not None else num_params
    each = CHECKPOINT_BYTES_PER_PARAM * trained
    kept = (f"; {keep} kept (--keep-checkpoints): {human_bytes(keep * each)}"
            if keep else "; every one kept (--keep-checkpoints 0)")
    return (f"disk      a checkpoint takes {human_bytes(each)} ({CHECKPOINT_BYTES_PER_PARAM} bytes per trained "
            f"parameter: fp32 weights and Adam's moments), {human_bytes(each / checked.world_size)} per rank{kept}")
