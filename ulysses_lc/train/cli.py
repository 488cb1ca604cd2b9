"""The command-line entry point: `main()` parses flags, trains (or dry-runs) and reports a failure once.

Failure reporting, for a job of many ranks on one node or several (job_watch.py carries reports between nodes):
  - a check that fails on any rank raises the same CheckFailed on every rank, once every rank's checks are agreed
    (the loop's start): each node's speaker prints it (rank 0 on node 0, the lowest rank elsewhere), the others exit
    quietly;
  - any other failure is published on the job's store, then printed by the rank it happened on: a node's speaker
    and the job's first report at once, the others after GRACE_S, so that a failure every rank shares is printed
    about once per node (the launcher stops the others when the speaker exits). Every other node's speaker prints
    the published report as its last line;
  - a rank that only lost contact with a failed peer (a gloo/NCCL error) waits up to LOST_PEER_S for the cause to
    be found (job_watch.await_cause: a report on the store, a peer's pid gone, a silent node), which ends it; without
    one it says "lost contact";
  - Ctrl-C before the run's own signal handlers are armed (the start-up checks, the process group's start) raises
    KeyboardInterrupt on every rank the terminal's group holds: one line on rank 0, exit 130 on each, no traceback
    (nothing was trained or written yet); once armed, a signal is a stop asked of the run (stop.py);
  - a failing rank leaves with os._exit(1) instead of a normal exit, which could hang in a collective or in a
    process-group shutdown waiting for a dead peer. The message is the last thing the rank prints; user
    mistakes (ValueError, NonFiniteError) print without a traceback, since the message names the fix.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback

from ..parallel.distributed import destroy_distributed
from . import job_watch
from .console import quiet_warnings
from .job_table import await_launch_py, record_for_launcher
from .job_watch import GRACE_S
from .stop import Stopped

QUIET_LOGGERS = ("ulysses_lc.mixers.attention", "ulysses_lc.mixers.explicit_attention", "ulysses_lc.levers.yarn")
LOST_PEER_S = 20.0
LAUNCH_PY_S = 5.0  # DeepSpeed's launch.py polls its ranks once a second, then ends the live ones in turn
# The most a stopped rank that launch.py ends last waits for it, while the ranks it ends first exit (job_table).
LAUNCH_PY_LIMIT_S = 120.0


def main(argv=None) -> None:
    """Run the main job from the command line (examples/train_1m.py calls this); with --nproc-per-node N, start N
    ranks of it here and wait for them (launcher.py)."""
    from .launcher import split

    argv = sys.argv[1:] if argv is None else list(argv)
    launch_flags, job_argv = split(argv)
    if launch_flags is not None:
        sys.exit(_launch(launch_flags, job_argv))
    # Every rank runs the same code, so rank 0's log and warnings say all there is; the others' would repeat it.
    logging.basicConfig(level=logging.INFO if _rank() == 0 else logging.WARNING, format="%(message)s")
    # The start-up block names the kernel and the RoPE: the library's own info lines of them (for a loop of one's own,
    # a Trainer) would say it again, one of them inside the progress bar.
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    quiet_warnings(_rank())
    cfg, trained = None, False
    try:
        from .config import parse_args

        cfg = parse_args(argv)
        if cfg.dry_run:
            from .dry_run import dry_run
            from .estimate import DoesNotFit

            try:
                print(dry_run(cfg), flush=True)
            except DoesNotFit as e:  # the plan and prediction first, then (as every failure) the cause, last
                if e.report:
                    print(e.report, flush=True)
                raise
            return
        from .loop import train
        from .preflight import AlreadyTrained

        try:
            train(cfg)
        except AlreadyTrained as e:  # found by every rank's checks: nothing started, no failure to report
            if job_watch.speaks_for_node():
                print(str(e), flush=True)
        trained = True
        destroy_distributed()
    except SystemExit:
        raise
    except KeyboardInterrupt:  # where the run's own handlers are not armed: before its watch started, or after it
        _interrupted("after the run ended" if trained else "during the dry run" if cfg and cfg.dry_run
                     else "during the start-up checks, before training started: nothing was trained or written; the "
                          "same command starts the run")
    except Stopped as e:  # asked to stop, and stopped with a checkpoint: one line, and the signal's exit code
        last, ended = job_watch.ends_last_rank(), []  # DeepSpeed's launch.py ends this rank last (job_table.ends_last)
        if last:  # its SIGTERM comes once every other rank has exited (past the barrier below)
            signal.signal(signal.SIGTERM, lambda signum, frame: ended.append(signum))
        if job_watch.speaks_for_node() and not last:  # rank 0, and each other node's lowest rank on its console
            _say(str(e))
        destroy_distributed()
        if last:  # said again after launch.py's "Killing subprocess" lines, before its exit code's
            await_launch_py(*last, ended, LAUNCH_PY_S, LAUNCH_PY_LIMIT_S)
            _say(str(e))
        sys.exit(e.code)
    except BaseException as e:  # noqa: BLE001 - every failure ends here, reported once
        _fail(e)


def _launch(launch_flags, job_argv) -> int:
    from .config import parse_args
    from .launcher import launch

    cfg = parse_args(job_argv)  # a refused flag is said once, here, before any rank starts
    try:
        return launch(launch_flags, job_argv, cfg.stop_grace_s)
    except ValueError as e:  # a launch flag refused: nothing started
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    record_for_launcher(message)


def _interrupted(when: str) -> None:
    """Ctrl-C outside the run's stop handlers: one line (rank 0; Ctrl-C signals every rank of the terminal's group),
    and the exit code of a SIGINT on every rank; os._exit as in a failure, since the process group may be half up."""
    if _rank() == 0:
        message = f"stopped by SIGINT (Ctrl-C) {when}"
        print(message, file=sys.stderr, flush=True)
        record_for_launcher(message)
    sys.stdout.flush()
    os._exit(128 + signal.SIGINT)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


# What a collective raises when its peer is gone: gloo's transport (a plain RuntimeError) and NCCL's remote error,
# abort or watchdog timeout (DistBackendError). Matched only on those types, so an error that merely names a
# backend ("NCCL error: invalid argument", a shape bug inside a collective) keeps its traceback.
_PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe", "remote process",
              "remoteerror", "communicator was aborted", "watchdog caught collective operation timeout")


def _is_lost_peer(e: BaseException) -> bool:
    """Whether `e` only says that another rank is gone (its cause is that rank's to report), by error type."""
    import torch.distributed as dist

    if isinstance(e, (dist.DistNetworkError, dist.DistStoreError)):
        return True
    return type(e) in (RuntimeError, dist.DistBackendError) and any(s in str(e).lower() for s in _PEER_GONE)


def _fail(e: BaseException) -> None:
    from .checkpoint_files import SaveFailed
    from .divergence import NonFiniteError
    from .preflight import CheckFailed

    rank = _rank()
    user_error = isinstance(e, (ValueError, NonFiniteError, SaveFailed))
    message = str(e)
    where = f" ({job_watch.where(rank)})" if rank else ""
    if isinstance(e, CheckFailed):
        job_watch.claim_own_failure()
        job_watch.publish(message)  # found after the agreement (a plan that does not fit one node's memory)
        if e.origin:
            where = f" ({e.origin})"
        if not job_watch.speaks_for_node():  # every rank raised it; each node's speaker reports it and exits first
            time.sleep(GRACE_S)
            record_for_launcher(f"error{where}: {message}")
            os._exit(1)
    elif _is_lost_peer(e):
        # The failed peer's report, its pid gone or its node silent end this rank meanwhile (so does the launcher).
        hint = job_watch.await_cause(LOST_PEER_S)
        user_error = True  # the traceback would only show the collective this rank waited in
        message = (f"lost contact with another rank, which failed or was killed (its report, if any, is above){hint}: "
                   f"{e}")
    else:
        job_watch.claim_own_failure()
        first = job_watch.publish(message if user_error else f"{type(e).__name__}: {message}")
        if not job_watch.speaks_for_node() and not first:
            # a failure of every rank is reported by the speaker; the launcher ends this one meanwhile. The job's
            # first report prints at once: its node's speaker may already be gone with the job's store (node 0
            # ended on reading it), and the launcher would end this rank before it printed its own cause.
            time.sleep(GRACE_S)
    sys.stdout.flush()
    if not user_error:
        traceback.print_exception(e, file=sys.stderr)
    message = f"error{where}: {message}"
    print(message, file=sys.stderr, flush=True)
    record_for_launcher(message if user_error else "".join(traceback.format_exception(e)) + message)
    os._exit(1)
