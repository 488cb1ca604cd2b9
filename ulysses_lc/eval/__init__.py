"""Evaluation at length: loss by position bucket and passkey retrieval by depth, forward only, under SP.

positions (Buckets: position buckets with the trained length marked), passkey (haystacks of real text with a key
hidden at a depth), evaluate (`evaluate`: both, on a SequenceParallelCausalLM or its DeepSpeed engine), report
(EvalResult: one console line, JSON, tables, a before / after comparison, a PNG). The main job runs them with
--eval-every (train/evaluation.py); `ulysses-lc-eval` (cli.py, `python -m ulysses_lc.eval`) runs them on model
folders.
Imports: model, data, levers, parallel and the ground modules; cli.py, the command, also the main job's loading
(train/), so it stands above it and nothing here imports it.
"""

from .evaluate import evaluate
from .passkey import DEPTHS, Haystack, build_haystacks
from .positions import Buckets
from .report import BucketLoss, EvalResult, PasskeyDepth, compare_lines, plot

__all__ = ["Buckets", "BucketLoss", "DEPTHS", "EvalResult", "Haystack", "PasskeyDepth", "build_haystacks",
           "compare_lines", "evaluate", "plot"]
