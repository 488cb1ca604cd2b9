"""The main job: config and command line, loading, schedule, checkpoints, export, and the loop that joins them.

  TrainConfig, parse_args    what one run trains, from code or the command line  (config.py)
  RunSettings                the flags resolved once, split into each part's settings (settings.py)
  load_model_config, ...     config / tokenizer / weights from hub, folder, tiny (loading.py)
  lr_lambda                  warmup then constant / linear / cosine               (schedule.py)
  check_output_dir, ...      output-dir policy, RNG, save and resume              (run_state.py)
  resolve, record_resume     --resume and the flags: taken, applied or refused     (resume.py)
  verify, finite_state       checkpoint manifests (size, CRC-32), finite state    (checkpoint_files.py)
  StepGuard, NonFiniteError  a step gone wrong or blown up stops before its save  (divergence.py)
  hold_run_folder            one job per run folder: a lock for the run's life    (run_lock.py)
  StopRequest, Stopped       SIGTERM/SIGINT/launcher's end: stop at a step, saved (stop.py)
  export_hf_model            consolidated Hugging Face model at the end           (export.py)
  preflight                  every cheap check, before any collective            (preflight.py)
  estimate_memory            predicted GPU and host bytes per rank               (estimate.py)
  cache_environment, ...     the kernel cache: Triton's and inductor's folders    (kernel_cache.py)
  RunLogger, startup_block   what the run prints                                  (console.py)
  train                      the loop                                             (loop.py)
  dry_run                    checks, plan and predicted memory, nothing loaded    (dry_run.py)
  main                       the command line, with failures reported once       (cli.py)
  job_watch.start            every node's ranks end when one fails, the cause on rank 0's console (job_watch.py)
"""

from .run_state import CHECKPOINT_DIR, RUN_FILE, check_output_dir
from .config import TINY, TINY_DEFAULTS, TrainConfig, build_parser, parse_args
from .export import EXPORT_DIR, export_hf_model, gather_state_dict
from .loading import load_model, load_model_config, load_tokenizer
from .dry_run import dry_run
from .cli import main
from .divergence import NonFiniteError
from .loop import train
from .preflight import CheckFailed, preflight
from .schedule import lr_lambda
from .settings import RunSettings

__all__ = [
    "CHECKPOINT_DIR",
    "CheckFailed",
    "NonFiniteError",
    "EXPORT_DIR",
    "RUN_FILE",
    "RunSettings",
    "TINY",
    "TINY_DEFAULTS",
    "TrainConfig",
    "build_parser",
    "dry_run",
    "check_output_dir",
    "export_hf_model",
    "gather_state_dict",
    "load_model",
    "load_model_config",
    "load_tokenizer",
    "lr_lambda",
    "main",
    "parse_args",
    "preflight",
    "train",
]
