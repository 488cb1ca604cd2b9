"""One job, one command line: every rank's flags, compared once the process group is up.

Each node parses its own command line, and some of what it says is taken from rank 0 for the whole job (the run
folder, the data position, what global rank 0 writes), so a node started with another --output-dir (or any other
flag) would be overridden without a word. Every field of TrainConfig is compared instead; one that differs
anywhere is refused on every rank alike, naming the ranks, nodes and values, with the fix.
"""

from __future__ import annotations

from dataclasses import asdict

from .preflight import CheckFailed


def check_same_flags(cfg, layout) -> None:
    """CheckFailed on every rank when any TrainConfig field differs between ranks (the same gathered lists on every
    rank: each raises the same message, so no rank is left waiting). Collective over the world group."""
    import torch.distributed as dist

    mine = asdict(cfg)
    everyone = [None] * layout.world_size
    dist.all_gather_object(everyone, mine, group=layout.world_group)
    differing = [name for name in mine if any(flags[name] != everyone[0][name] for flags in everyone)]
    if not differing:
        return
    nodes = layout.nodes or (0,) * layout.world_size

    def values(name: str) -> str:
        groups: dict[str, list[int]] = {}
        for rank, flags in enumerate(everyone):
            groups.setdefault(repr(flags[name]), []).append(rank)
        return "; ".join(f"{value} on rank{'s' if len(ranks) > 1 else ''} {_span(ranks)} (node"
                         f"{'s' if len({nodes[r] for r in ranks}) > 1 else ''} "
                         f"{', '.join(map(str, sorted({nodes[r] for r in ranks})))})" for value, ranks in groups.items())

    flags = ", ".join(f"--{name.replace('_', '-')}" for name in differing)
    detail = "\n  ".join(f"--{name.replace('_', '-')}: {values(name)}" for name in differing)
    raise CheckFailed(
        f"{flags} differ{'s' if len(differing) == 1 else ''} between ranks; one job has one command line (rank 0's "
        f"run folder and data would be every node's, the others' ignored):\n  {detail}\nStart every node with the same "
        "flags: for --output-dir the same path (a shared folder, or that path on each node's own disk, which the job "
        "finds and writes per node).")


def _span(ranks: list[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)) \
        else ", ".join(map(str, ranks))
