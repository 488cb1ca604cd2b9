"""Many nodes (issue 20): the main job on simulated nodes (launchers with --nnodes/--node_rank on 127.0.0.1) trains
as one node of the same ranks does, on node-local disks and on a shared folder, under torchrun, DeepSpeed's runner
and srun's variables; the SP groups are placed inside nodes, and the start-up block and the dry run say where."""

import json
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from tests._dist import run_distributed, run_shared
from tests._nodes import REPO, launch_nodes
from ulysses_lc.parallel.distributed import expand_nodelist, mpi_variables, node_id, slurm_variables
from ulysses_lc.parallel.layout import ParallelLayout, nodes_of, sp_group_ranks
from ulysses_lc.train import TrainConfig, dry_run, parse_args

ARGS = ["--seq-len", "512", "--lr-schedule", "constant", "--no-export", "--output-dir", "run", "--save-every", "1", "--cache-dir", "cache"]
# constant lr: a run of 2 steps resumed to 4 follows the 4-step run (a cosine schedule depends on --steps)
MAIN = ["-m", "ulysses_lc.train"]


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def _ok(results) -> None:
    for node, (rc, out, _) in enumerate(results):
        assert rc == 0, f"node {node} exit {rc}:\n{out[-6000:]}"


# -- placement ---------------------------------------------------------------------------------------------------

def test_sp_groups_sit_inside_nodes_whatever_order_the_launcher_numbers_ranks():
    # Each node's ranks together (torchrun, deepspeed, srun --distribution=block): SP groups are runs of ranks.
    assert sp_group_ranks(8, 2, nodes_of(8, 4)) == ((0, 1), (2, 3), (4, 5), (6, 7))
    # srun --distribution=cyclic interleaves nodes: rank r on node r % 2. SP groups still take one node's ranks.
    cyclic = (0, 1, 0, 1, 0, 1, 0, 1)
    groups = sp_group_ranks(8, 4, cyclic)
    assert groups == ((0, 2, 4, 6), (1, 3, 5, 7)) and all(len({cyclic[r] for r in g}) == 1 for g in groups)
    layout = ParallelLayout(8, 4, rank=5, nodes=cyclic)
    assert (layout.sp_rank, layout.dp_rank) == (2, 1)  # rank 5 is node 1's third rank: SP slice 2 of sequence 1
    assert layout.dp_groups == ((0, 1), (2, 3), (4, 5), (6, 7))  # DP across the two nodes
    # sp larger than a node: each SP group spans whole consecutive nodes, and says so.
    wide = ParallelLayout(16, 8, nodes=nodes_of(16, 4))
    assert wide.sp_groups == (tuple(range(8)), tuple(range(8, 16))) and wide.sp_group_nodes == 2
    assert "span up to 2 nodes" in wide.placement_line() and "sp 8 > 4 ranks per node" in wide.placement_line()
    # --sp-placement across: the reverse, SP over nodes and DP inside each.
    across = ParallelLayout(4, 2, nodes=nodes_of(4, 2), placement="across")
    assert across.sp_groups == ((0, 2), (1, 3)) and across.dp_groups == ((0, 1), (2, 3))
    assert "crosses the network (--sp-placement across)" in across.placement_line()
    inside = ParallelLayout(16, 8, nodes=nodes_of(16, 8))
    assert "each SP group of 8 inside one node" in inside.placement_line() and "DP across nodes" in inside.placement_line()
    with pytest.raises(ValueError, match="pick one of node, across"):
        ParallelLayout(4, 2, placement="ring")


def test_dry_run_names_the_placement_and_the_host_share(tmp_path):
    from ulysses_lc.train.estimate import limits_for
    from ulysses_lc.train.settings import RunSettings

    cfg = TrainConfig(model="tiny", data="tiny", seq_len=4096, dry_run=True, world_size=16, sp_size=4,
                      gpus_per_node=8, host_memory_gb=64)
    text = dry_run(cfg)
    assert "16 ranks = sp 4" in text and "2 nodes x 8 ranks: each SP group of 4 inside one node" in text
    # Without --host-memory-gb, on the node: its memory shared by its 8 ranks, not by the world's 16.
    assert "over 8 local ranks" in limits_for(RunSettings(replace(cfg, host_memory_gb=None)).plan, 16, ranks_here=8)[1]
    wide = dry_run(replace(cfg, sp_size=16 // 4, gpus_per_node=2))
    assert "8 nodes x 2 ranks: SP groups span up to 2 nodes" in wide and "sp 4 > 2 ranks per node" in wide


def test_srun_and_mpirun_variables_fill_torchs(monkeypatch):
    env = {"SLURM_STEP_NUM_TASKS": "16", "SLURM_PROCID": "9", "SLURM_NODEID": "1", "SLURM_LOCALID": "1",
           "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_STEP_TASKS_PER_NODE": "8(x2)", "SLURM_JOB_ID": "4242"}
    got = slurm_variables(env)
    assert got == {"RANK": "9", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "8",
                   "MASTER_ADDR": "gpu07", "MASTER_PORT": str(20000 + 4242)}
    assert slurm_variables({**env, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"})["MASTER_ADDR"] == "10.0.0.1"
    # A batch script's own process (no srun step) is one process, whatever the allocation's SLURM_NTASKS.
    assert slurm_variables({"SLURM_NTASKS": "16", "SLURM_PROCID": "0", "SLURM_JOB_ID": "1"}) is None
    assert expand_nodelist("gpu[01-03,10],login1") == ["gpu01", "gpu02", "gpu03", "gpu10", "login1"]
    assert slurm_variables({**env, "SLURM_STEP_TASKS_PER_NODE": "8,4", "SLURM_NODEID": "1"})["LOCAL_WORLD_SIZE"] == "4"
    # mpirun (deepspeed --launcher openmpi): MPI's variables, and a MASTER_ADDR the user exports, else refused (each
    # rank would otherwise start a job of one on its own).
    ompi = {"OMPI_COMM_WORLD_SIZE": "16", "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "3",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "8"}
    assert mpi_variables({**ompi, "MASTER_ADDR": "gpu-a"}) == {
        "RANK": "3", "WORLD_SIZE": "16", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "gpu-a",
        "MASTER_PORT": "29500"}
    with pytest.raises(ValueError, match="MASTER_ADDR is not set.*mpirun -x MASTER_ADDR"):
        mpi_variables(ompi)
    assert mpi_variables({"PMI_SIZE": "1", "PMI_RANK": "0"})["WORLD_SIZE"] == "1"  # one rank needs no address
    assert mpi_variables({}) is None
    for name in ("GROUP_RANK", "CROSS_RANK", "SLURM_NODEID"):
        monkeypatch.delenv(name, raising=False)
    plain = node_id()
    monkeypatch.setenv("GROUP_RANK", "1")  # torchrun's node index: simulated nodes on one host are two nodes
    assert node_id() == f"{plain}/1"


# -- the main job on two simulated nodes ---------------------------------------------------------------------------

def _one_node_worker(rank, world_size, cfgs):
    """The main job's loop on these ranks of one node, once per config; each run's losses."""
    from ulysses_lc.train import train

    os.environ["OMP_NUM_THREADS"] = "1"  # as node_env gives the launched nodes' ranks: the same threads, same sums
    return {sp: [r["loss"] for r in train(cfg)] for sp, cfg in cfgs.items()}


@pytest.fixture(scope="module")
def one_node(tmp_path_factory):
    """The reference: one node of 4 ranks, at sp 2 and at sp 4 (4 steps each), from the nodes' own flags. Trained
    here without a launcher (the launchers are what the tests below check, not what the reference needs), in one
    start of 4 fresh ranks: the suite's shared 4-rank pool runs plain bodies, which a DeepSpeed body would make
    restart twice (here and at the next plain test)."""
    folder = tmp_path_factory.mktemp("one_node")
    cfgs = {sp: replace(parse_args([*ARGS, "--steps", "4", "--sp-size", str(sp)]), output_dir=str(folder / f"sp{sp}"),
                        cache_dir=str(folder / "cache")) for sp in (2, 4)}
    return run_distributed(_one_node_worker, 4, cfgs)[0]


def test_two_nodes_on_local_disks_train_save_and_resume_like_one_node(tmp_path, one_node):
    # sp 2 x dp 2 on 2 nodes x 2 ranks: each SP group inside a node, DP across; one folder per node (local disks).
    # Started by DeepSpeed's hostfile launcher as on a cluster without passwordless ssh (--no_ssh --node_rank on
    # each node), resumed by srun (one task per rank, SLURM's variables only).
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    first = launch_nodes([str(REPO / "examples" / "train_1m.py"), *ARGS, "--steps", "2", "--sp-size", "2"], nodes,
                         launcher="deepspeed")
    _ok(first)
    out0 = first[0][1]
    assert "2 nodes x 2 ranks: each SP group of 2 inside one node" in out0
    assert "run folder node-local (1 of 2 nodes see this copy)" in out0
    for node in nodes:  # each node's folder is complete for its own ranks: run.json and latest of its own
        assert (node / "run" / "run.json").is_file() and (node / "run/checkpoints/latest").read_text() == "step2"
    ranks = {n: sorted(p.name.split("_")[3] for p in (n / "run/checkpoints/step2").glob("*optim_states.pt")) for n in nodes}
    assert ranks == {nodes[0]: ["0", "1"], nodes[1]: ["2", "3"]}
    assert not (nodes[1] / "run" / "metrics.jsonl").exists()  # one record of the run: global rank 0's
    resumed = launch_nodes([*MAIN, *ARGS, "--steps", "4", "--sp-size", "2", "--resume"], nodes, launcher="srun")
    _ok(resumed)
    assert "resumed step 2 on the layout that saved it" in resumed[0][1] and "2 nodes x 2 ranks: each SP group of 2" in resumed[0][1]
    # fp32 on CPU, the same ranks in the same groups as one node: the same sums in the same order. 1e-6 allows a
    # different gloo algorithm choice, far below a step's change in loss (~5e-2).
    np.testing.assert_allclose(_losses(nodes[0] / "run"), one_node[2], rtol=1e-6)
    for node in nodes:  # the pruning ran on each node's copy: --keep-checkpoints 2
        assert sorted(p.name for p in (node / "run/checkpoints").glob("step*")) == ["step3", "step4"]


def test_two_torchrun_nodes_sharing_a_folder_at_sp_4_train_like_one_node(tmp_path, one_node):
    # sp 4 over 2 nodes x 2 ranks: the SP group spans both nodes (stated); one shared folder for both nodes.
    shared = tmp_path / "shared"
    results = launch_nodes([*MAIN, *ARGS, "--steps", "4", "--sp-size", "4"], [shared, shared])
    _ok(results)
    out0 = results[0][1]
    assert "SP groups span up to 2 nodes, so the all-to-all crosses the network (sp 4 > 2 ranks per node)" in out0
    assert "run folder shared by all 2 nodes" in out0 and "token cache shared by all 2 nodes" in out0
    np.testing.assert_allclose(_losses(shared / "run"), one_node[4], rtol=1e-6)


# -- who writes what ---------------------------------------------------------------------------------------------

def _owner_worker(rank, world_size, tmp):
    import torch

    from ulysses_lc.train.files import folder_owner

    layout = ParallelLayout(4, 2, rank=rank, nodes=(0, 0, 1, 1))  # 2 nodes x 2 ranks; the default group
    node = layout.nodes[rank]
    shared = folder_owner(Path(tmp) / "shared", layout)
    local = folder_owner(Path(tmp) / f"local{node}", layout)  # each node its own folder, as its own disk
    torch.distributed.barrier()  # every rank has removed what it made
    return {"shared": (shared.writes, shared.shared_by, shared.node_local),
            "local": (local.writes, local.shared_by, local.node_local),
            "left": sorted(p.name for p in Path(tmp).iterdir())}


def test_one_writer_per_folder_whether_shared_or_node_local(tmp_path):
    results = run_shared(_owner_worker, 4, str(tmp_path))
    assert [r["shared"] for r in results] == [(True, (0, 1), False)] + [(False, (0, 1), False)] * 3
    assert [r["local"] for r in results] == [(True, (0,), True), (False, (0,), True), (True, (1,), True),
                                             (False, (1,), True)]
    assert all(r["left"] == [] for r in results)  # the probes, and the folders made for them, are gone


def test_two_builders_of_one_cache_key_take_turns(tmp_path):
    # Two jobs' builders (threads here: flock excludes two open files alike) on one key: the second waits for the
    # first and reuses its cache. The first waits up to 2 s for the second to start building, which it must not.
    import threading

    import numpy as np

    from ulysses_lc.data.cache import CachePaths, build_or_reuse

    paths = CachePaths(tmp_path, "key")
    building, builds = threading.Event(), []

    def build():
        builds.append(threading.current_thread().name)
        if len(builds) == 1:
            building.set()
            second.wait_started.wait(2.0)
        else:
            second.wait_started.set()
        return {"tokens": np.arange(8, dtype=np.uint32)}, {}

    hits = {}
    first = threading.Thread(target=lambda: hits.setdefault("first", build_or_reuse(paths, build, {})), name="first")
    second = threading.Thread(target=lambda: hits.setdefault("second", build_or_reuse(paths, build, {})), name="second")
    second.wait_started = threading.Event()
    first.start()
    building.wait(30)
    second.start()
    first.join(60)
    second.join(60)
    assert builds == ["first"] and hits == {"first": False, "second": True}
