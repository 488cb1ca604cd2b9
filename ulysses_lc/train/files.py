"""Which rank writes which file of a run, whether its folders are on one shared file system or on node-local disks.

A job on many nodes may see one folder (NFS, Lustre: every node reads what any wrote) or one folder per node
(each node's local disk under the same path). What each rank writes follows from that:
  - DeepSpeed's checkpoint shards: every rank its own (ZeRO-3 names them by global rank), wherever it runs;
  - the run's own files (run.json, checkpoints/latest, the pruning of old checkpoints): once per folder, by the
    first rank of the lowest node that sees it (`FolderOwner.writes`), so on node-local disks each node's folder
    is complete for that node's ranks and on a shared one a single writer touches them;
  - the token cache: built once per cache folder the same way, the job's other ranks waiting for it;
  - metrics.jsonl, TensorBoard, the Hugging Face export: global rank 0 only (one record of the run).
Which nodes share a folder is found by looking, not by asking: each node's first rank writes a probe file named
with a token of this job, and reads which nodes' probes it sees (`folder_owner`).

On --resume every rank reads `latest` of its own folder; the ranks then agree on the newest checkpoint that
every rank holds its files of (`agree_on_checkpoint`), so a node that crashed mid-save resumes with the others.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

PROBE = ".ulysses_lc-probe"


@dataclass(frozen=True)
class FolderOwner:
    """How one folder is seen by the job, from this rank."""

    writes: bool  # this rank writes the folder's single-writer files
    shared_by: tuple[int, ...]  # the nodes that see this rank's copy of the folder (one: node-local)
    num_nodes: int

    @property
    def node_local(self) -> bool:
        return self.num_nodes > 1 and len(self.shared_by) < self.num_nodes

    def describe(self) -> str:
        if self.num_nodes == 1:
            return "one node"
        if not self.node_local:
            return f"shared by all {self.num_nodes} nodes"
        return f"node-local ({len(self.shared_by)} of {self.num_nodes} nodes see this copy)"


def _nodes(layout) -> tuple[int, ...]:
    return layout.nodes if layout.nodes is not None else (0,) * layout.world_size


def folder_owner(folder: Path, layout) -> FolderOwner:
    """Collective over every rank of `layout`: find which nodes share `folder` and whether this rank writes it.

    Each node's first rank writes `.ulysses_lc-probe-<job token>-<node>` (creating the folder for it), all ranks
    meet, each first rank lists the probes it can see, and the lowest node among them owns the copy. The probes and
    any folder made for them are removed again, so a run refused later leaves nothing behind.
    """
    nodes = _nodes(layout)
    node = nodes[layout.rank]
    first = nodes.index(node) == layout.rank  # this node's lowest rank
    token = [uuid.uuid4().hex[:12] if layout.rank == 0 else None]
    dist.broadcast_object_list(token, src=0, group=layout.world_group)
    probe = Path(folder) / f"{PROBE}-{token[0]}-{node}"
    made = []
    if first:
        missing = Path(folder)
        while not missing.exists():
            made.append(missing)
            missing = missing.parent
        Path(folder).mkdir(parents=True, exist_ok=True)
        probe.write_text(str(layout.rank))
    dist.barrier(group=layout.world_group)
    seen = None
    if first:
        seen = tuple(sorted(int(p.name.rsplit("-", 1)[1]) for p in Path(folder).glob(f"{PROBE}-{token[0]}-*")))
    every = [None] * layout.world_size
    dist.all_gather_object(every, seen, group=layout.world_group)
    if first:  # every first rank has looked (its listing came before the gather): the probes can go
        probe.unlink(missing_ok=True)
    dist.barrier(group=layout.world_group)  # every probe is gone: what was made for them can go too
    if first:
        for path in made:  # deepest first; on a shared folder another node may have removed it already
            try:
                path.rmdir()
            except OSError:
                break
    # Every node has removed what it made before any rank goes on: on a shared folder two nodes may each have made
    # it, and a late rmdir of the other's would take away the folder the writer has just made again for its lock.
    dist.barrier(group=layout.world_group)
    shared_by = every[nodes.index(node)]
    return FolderOwner(writes=first and node == min(shared_by), shared_by=shared_by, num_nodes=len(set(nodes)))


def agree_on_run_dir(out: Path | None, new_name, layout) -> Path:
    """The run folder every rank uses: rank 0's (its --output-dir, the run its --resume found, or a new name from
    `new_name()`), so ranks on other nodes, whose clocks and runs/ folders may differ, write to the same name."""
    name = [None if layout.rank else str(out if out is not None else new_name())]
    dist.broadcast_object_list(name, src=0, group=layout.world_group)
    return Path(name[0])


def own_checkpoints(ckpt_dir: Path, rank: int, latest: str | None) -> list[int]:
    """Steps up to `latest` whose folder holds this rank's files (DeepSpeed's ZeRO-3 shards are named by rank)."""
    if latest is None:
        return []
    newest = int(latest.removeprefix("step"))
    steps = []
    for tag in Path(ckpt_dir).glob("step*"):
        if tag.name[4:].isdigit() and int(tag.name[4:]) <= newest and any(tag.glob(f"*_pp_rank_{rank}_mp_rank_*")):
            steps.append(int(tag.name[4:]))
    return sorted(steps)


def agree_on_checkpoint(ckpt_dir: Path, latest: str | None, layout) -> tuple[str, str | None]:
    """Collective: the newest checkpoint step every rank can resume from (a checkpoint of this job's world size:
    each rank holds its own files), as (tag, a line saying why when it is not this folder's `latest`). ValueError,
    naming the ranks and the fix, when there is none."""
    mine = own_checkpoints(ckpt_dir, layout.rank, latest)
    every = [None] * layout.world_size
    dist.all_gather_object(every, (mine, latest), group=layout.world_group)
    common = set(every[0][0]).intersection(*(set(steps) for steps, _ in every[1:]))
    if not common:
        missing = [r for r, (steps, _) in enumerate(every) if not steps]
        raise ValueError(
            f"--resume: no checkpoint in {ckpt_dir} holds the files of every rank (none for rank(s) "
            f"{', '.join(map(str, missing)) or 'in common'}); on node-local disks each node's folder must hold its "
            "own ranks' checkpoint files: resume on the same nodes, or copy every node's checkpoints/ folder into "
            "one shared folder and pass it as --output-dir.")
    step = max(common)
    tag = f"step{step}"
    newest = {latest for _, latest in every if latest}
    note = None
    if newest != {tag}:
        note = (f"resuming from {tag}, the newest checkpoint every rank holds its files of (latest names "
                f"{', '.join(sorted(newest))} on some nodes: a save cut short there)")
    return tag, note


__all__ = ["FolderOwner", "agree_on_checkpoint", "agree_on_run_dir", "folder_owner", "own_checkpoints"]
