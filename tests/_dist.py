"""Run a test body on N ranks in fresh processes and collect what each rank returns.

The body must be a module-level function `fn(rank, world_size, *args)`; it runs after
`torch.distributed` is initialised (gloo unless `backend="nccl"`, which also binds rank r to GPU r)
and its return value (picklable) comes back as `results[rank]`. A failure on any rank fails the test
with that rank's traceback; so does a rank that dies without a result, or exits with a code other than 0 after
one (each rank ends with ulysses_lc's destroy_distributed and a full interpreter exit, so every multi-rank test
also checks that a run ends cleanly).
"""

import atexit
import gc
import os
import pickle
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ulysses_lc.parallel.distributed import destroy_distributed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_rank(rank, world_size, port, backend):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    # Two CI cores shared by up to four ranks: one intra-op thread each avoids oversubscription.
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size)


def _worker(rank, world_size, port, fn, args, queue, backend):
    try:
        _init_rank(rank, world_size, port, backend)
        result = fn(rank, world_size, *args)
        _check_no_shm_comm_op()
        # Plain pickle bytes: torch's queue pickler would pass tensors as shared-memory handles
        # that vanish when this process exits.
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - the traceback is the test's report
        queue.put((rank, "error", traceback.format_exc()))
        if dist.is_initialized():
            dist.destroy_process_group()  # no barrier: the other ranks may never reach one
        return
    # The library's own end of a run, so that every multi-rank test also checks that a rank exits cleanly (the
    # parent fails the test on a nonzero exit code after a result).
    destroy_distributed()


def _check_no_shm_comm_op():
    """No test reaches DeepSpeed's CPU shm all-reduce op: building it takes a lock that a killed build leaves behind
    (every later run then hangs), and it maps /dev/shm buffers nothing unlinks (ulysses_lc/parallel/distributed.py)."""
    ds_comm = sys.modules.get("deepspeed.comm.comm")
    if ds_comm is not None and getattr(ds_comm.cdb, "shm_comm_op", None) is not None:
        raise AssertionError("DeepSpeed built its CPU shm op: start the process group with "
                             "ulysses_lc.parallel.distributed.init_distributed, not deepspeed.init_distributed")


def run_distributed(fn, world_size, *args, timeout=600, backend="gloo"):
    """fn on world_size ranks in fresh processes; every rank's return value."""
    return _retry_port(lambda: _run_once(fn, world_size, args, timeout, backend))


def run_shared(fn, world_size, *args, timeout=600, kind="plain"):
    """fn on the session's shared gloo ranks of world_size and kind; every rank's return value.

    Starting a rank costs seconds of imports (torch, transformers, DeepSpeed, the test module): a no-op launch of 2
    ranks took 12.7 s on 2 cores, of 4 ranks 24.6 s, and the suite made dozens. Bodies run one after another on
    one set of ranks per world size and kind instead (MAX_POOLS of them alive at once), each running bodies of one kind:
      "plain": bodies that compute and communicate over groups they build; no DeepSpeed, Trainer or loop.
      "deepspeed": bodies that start DeepSpeed (an engine, the training loop): each starts its own engine,
        as the main job's tests already did several times in one process.
      "trainer": bodies that build a transformers Trainer; after each, the state a Trainer leaves in its process is
        reset (accelerate's state objects, transformers' ZeRO-3 switch, which would put the next body's model
        under zero.Init).
    A body reads nothing from the test's environment or sys.path (its ranks may have started before the test)
    and undoes any patch before it returns. After each body every rank destroys the groups the body created (a
    barrier on each first; through DeepSpeed where it runs, which drops its references too), so the next body
    starts from the default group alone. A body that fails on any rank ends those ranks; the next call starts new
    ones.
    """
    key = (world_size, kind)

    def once():
        pool = _POOLS.pop(key, None)
        if pool is None:
            while len(_POOLS) >= MAX_POOLS:  # the least recently used set of ranks goes
                _POOLS.pop(next(iter(_POOLS))).close()
            pool = _Pool(world_size, kind)
        _POOLS[key] = pool  # last: the most recently used
        try:
            return pool.run(fn, args, timeout)
        except BaseException:
            _POOLS.pop(key).close(grace_s=5)
            raise

    return _retry_port(once)


def _retry_port(call):
    # The free port is found, closed, then bound again by rank 0: another process (a test suite running beside
    # this one) can take it in between. Only that failure is retried, on a new port.
    for attempt in range(3):
        try:
            return call()
        except AssertionError as e:
            if "EADDRINUSE" not in str(e) or attempt == 2:
                raise


_POOLS = {}  # (world_size, kind) -> _Pool, for the session, least recently used first
# Sets of ranks kept alive at once. Test files alternate kinds and world sizes, and a set closed at each switch was
# started again minutes later (12-25 s each on 2 cores, ~30 times a suite); an idle rank costs only its memory
# (~0.5 GB with torch, transformers and DeepSpeed imported), so a few sets stay.
MAX_POOLS = 5


class _Pool:
    """world_size ranks with a gloo group, each running the bodies it is sent, one at a time."""

    def __init__(self, world_size, kind):
        self.kind = kind
        ctx = mp.get_context("spawn")
        self.results = ctx.SimpleQueue()
        self.tasks = [ctx.SimpleQueue() for _ in range(world_size)]
        port = _free_port()
        # daemon: no rank outlives the session, even one the atexit close below could not end
        self.procs = [ctx.Process(target=_pool_worker, args=(r, world_size, port, kind, self.tasks[r], self.results),
                                  daemon=True) for r in range(world_size)]
        for p in self.procs:
            p.start()

    def run(self, fn, args, timeout):
        task = pickle.dumps((fn, args))  # plain pickle, as the results: no shared-memory handles for tensors
        for queue in self.tasks:
            queue.put(task)
        results, errors = _collect(self.procs, self.results, timeout)
        if errors:
            raise AssertionError("\n".join(errors))
        return [results[r] for r in range(len(self.procs))]

    def close(self, grace_s=120):
        for queue in self.tasks:
            queue.put(None)
        for p in self.procs:
            p.join(timeout=grace_s)
            if p.is_alive():
                p.kill()
                p.join()


@atexit.register
def _close_pools():
    while _POOLS:
        _POOLS.popitem()[1].close()


def _pool_worker(rank, world_size, port, kind, tasks, results):
    from torch.distributed.distributed_c10d import _world

    try:
        _init_rank(rank, world_size, port, "gloo")
    except BaseException:  # noqa: BLE001 - reported as the first body's failure
        results.put((rank, "error", traceback.format_exc()))
        return
    while (task := tasks.get()) is not None:
        fn, args = pickle.loads(task)
        before = set(_world.pg_map)
        try:
            result = fn(rank, world_size, *args)
            _check_no_shm_comm_op()
            results.put((rank, "ok", pickle.dumps(result)))
        except BaseException:  # noqa: BLE001 - the traceback is the test's report; the parent ends these ranks
            results.put((rank, "error", traceback.format_exc()))
            return
        del result
        created = [g for g in list(_world.pg_map) if g not in before]  # creation order: the same on every rank
        for group in created:
            dist.barrier(group=group)
        ds_comm = sys.modules.get("deepspeed.comm")
        destroy = ds_comm.destroy_process_group if ds_comm is not None and ds_comm.is_initialized() else \
            dist.destroy_process_group
        for group in created:
            destroy(group)
        ds_groups = sys.modules.get("deepspeed.utils.groups")
        if ds_groups is not None:  # an engine's mpu and groups, now destroyed, would be the next body's (TRL's
            # reference engine in a DPO test after a Trainer one: 'Group ... is not registered')
            ds_groups.mpu = None
            for name in ("_WORLD_GROUP", "_DATA_PARALLEL_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP"):
                setattr(ds_groups, name, None)
        if kind == "trainer":
            from accelerate.state import AcceleratorState
            from transformers.integrations.deepspeed import unset_hf_deepspeed_config

            unset_hf_deepspeed_config()
            AcceleratorState._reset_state(reset_partial_state=True)
        gc.collect()  # the body's groups go now, with their gloo threads, not at interpreter exit
    destroy_distributed()


def _run_once(fn, world_size, args, timeout, backend):
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(rank, world_size, port, fn, args, queue, backend))
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    results, errors = {}, ["interrupted"]
    try:
        results, errors = _collect(procs, queue, timeout)
    finally:  # no rank outlives its test: after an error the others may wait in a collective forever
        for p in procs:
            p.join(timeout=5 if errors else 120)
            if p.is_alive():
                p.kill()
                p.join()
    if not errors:
        errors = [f"rank {r} exited with code {p.exitcode} after its result: an unclean end of the process group "
                  "(ulysses_lc.parallel.distributed.destroy_distributed says why it aborts)"
                  for r, p in enumerate(procs) if p.exitcode != 0]
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]


def _collect(procs, queue, timeout):
    """Each rank's report; the first error ends the wait. A rank that exits without one (killed, aborted, or
    dead before its body ran: an import error in a spawned child) is reported at once, not waited on forever:
    SimpleQueue.put writes to the pipe before the process can exit, so a dead rank's report is already there."""
    results, errors = {}, []
    deadline = time.monotonic() + timeout
    while len(results) < len(procs) and not errors:
        if not queue.empty():
            rank, status, payload = queue.get()
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors.append(f"rank {rank}:\n{payload}")
            continue
        dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode is not None]
        if dead and queue.empty():
            errors.append(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} before reporting a result "
                          "(its stderr, above, says why)")
        elif time.monotonic() > deadline:
            errors.append(f"no result from ranks {sorted(set(range(len(procs))) - set(results))} in {timeout} s")
        else:
            procs[0].join(0.05)  # a short wait for the next report or exit, then look again
    return results, errors


def nccl_test_backend():
    """(backend, pytestmark) of the NCCL tests: ULYSSES_NCCL_TEST_BACKEND, "nccl" by default (skipped without two
    CUDA devices) or "gloo" (the same bodies on CPU, to check their logic)."""
    import pytest

    backend = os.environ.get("ULYSSES_NCCL_TEST_BACKEND", "nccl")
    if backend == "nccl":
        return backend, pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                           reason="needs two CUDA devices (NCCL); ULYSSES_NCCL_TEST_BACKEND=gloo runs "
                                                  "the same bodies on CPU")
    if backend != "gloo":
        raise ValueError(f"ULYSSES_NCCL_TEST_BACKEND={backend!r}: pick nccl (the default) or gloo")
    return backend, []
