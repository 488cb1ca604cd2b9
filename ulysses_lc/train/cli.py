"""The command-line entry point: `main()` parses flags, trains (or dry-runs) and reports a failure once.

Failure reporting, for a job of many ranks:
  - a check that fails raises the same CheckFailed on every rank before any collective (preflight.py):
    rank 0 prints it, the others exit quietly;
  - any other failure is printed by the rank it happened on; rank 0 at once, the others after GRACE_S, so
    that a failure every rank shares is printed once (the launcher stops the others when rank 0 exits);
  - a rank that only lost contact with a failed peer (a gloo/NCCL error) prints nothing for LOST_PEER_S:
    the peer's own report is the cause and the launcher ends this rank meanwhile;
  - a failing rank leaves with os._exit(1) instead of a normal exit, which could hang in a collective or in a
    process-group shutdown waiting for a dead peer. The message is the last thing the rank prints; user
    mistakes (ValueError, NonFiniteError) print without a traceback, since the message names the fix.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback

from ..distributed import destroy_distributed
from .console import quiet_warnings

GRACE_S = 3.0
LOST_PEER_S = 20.0


def main(argv=None) -> None:
    """Run the main job from the command line (examples/train_1m.py calls this)."""
    # Every rank runs the same code, so rank 0's log and warnings say all there is; the others' would repeat it.
    logging.basicConfig(level=logging.INFO if _rank() == 0 else logging.WARNING, format="%(message)s")
    quiet_warnings(_rank())
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

        train(cfg)
        destroy_distributed()
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - every failure ends here, reported once
        _fail(e)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _is_lost_peer(e: BaseException) -> bool:
    import torch.distributed as dist

    text = str(e).lower()
    return isinstance(e, dist.DistError) or any(
        s in text for s in ("connection closed by peer", "connection reset", "broken pipe", "nccl", "gloo"))


def _fail(e: BaseException) -> None:
    from .loop import NonFiniteError
    from .preflight import CheckFailed

    rank = _rank()
    user_error = isinstance(e, (ValueError, NonFiniteError))
    message = str(e)
    if isinstance(e, CheckFailed):
        if rank != 0:  # every rank found the same; rank 0 reports it and exits first, named as the first failure
            time.sleep(GRACE_S)
            os._exit(1)
    elif _is_lost_peer(e):
        time.sleep(LOST_PEER_S)  # the failed peer reports; the launcher ends this rank meanwhile
        user_error = True  # the traceback would only show the collective this rank waited in
        message = f"lost contact with another rank, which failed or was killed (its report, if any, is above): {e}"
    elif rank != 0:
        time.sleep(GRACE_S)  # a failure of every rank is reported by rank 0; the launcher ends this one meanwhile
    sys.stdout.flush()
    if not user_error:
        traceback.print_exception(e, file=sys.stderr)
    where = f" (rank {rank})" if rank else ""
    message = f"error{where}: {message}"
    print(message, file=sys.stderr, flush=True)
    _record_for_launcher(message if user_error else "".join(traceback.format_exception(e)) + message)
    os._exit(1)


def _record_for_launcher(text: str) -> None:
    """Write `text` where torchrun's closing summary reads the root cause (TORCHELASTIC_ERROR_FILE), so the summary,
    printed last, ends with the cause and its fix rather than a pointer to the docs. The file format is
    torch.distributed.elastic's error file ({"message": {"message", "extraInfo": {"py_callstack"}}})."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": text, "extraInfo": {"py_callstack": text, "timestamp": str(int(time.time()))}}}, f)
    except OSError:
        pass  # the report above already reached the user
