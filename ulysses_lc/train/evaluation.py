"""The main job's evaluation at --seq-len: eval/'s loss by position and passkey, in the training engine and SP layout.

On when --eval-every, --eval-data or --eval-at-start is given: every --eval-every steps, always after the last step,
and before the first with --eval-at-start. The text is --eval-data's first windows or, by default, the windows right
after those the run reads from --data (`build_token_stream(held_out=...)`): the run's windows wrap around before
them, so training never reads them, and its own windows are those it reads without an evaluation. The passkey hides
its keys in the same text. Each evaluation is one forward per window and per passkey depth, forward only (eval/
evaluate.py), and runs after the step's checkpoint, never while a stop is pending (the stop's grace is the
checkpoint's). Its line goes to the console, its record ({"step", "time", "eval"}) to metrics.jsonl, its numbers to
TensorBoard and W&B under eval/.
"""

from __future__ import annotations

from ..eval import build_haystacks, evaluate
from ..eval.data import eval_windows
from ..eval.report import EvalResult

EVAL_PASSKEY_DEPTHS = "0,0.25,0.5,0.75,1"  # --eval-passkey-depths' default


def passkey_depths(text: str) -> tuple[float, ...]:
    """--eval-passkey-depths as floats (empty for 'none'); ValueError naming the flag."""
    if text.strip().lower() == "none":
        return ()
    try:
        depths = tuple(float(d) for d in text.split(","))
    except ValueError:
        depths = ()
    if not depths or any(not 0.0 <= d <= 1.0 for d in depths):
        raise ValueError(f"--eval-passkey-depths {text!r}: give shares of the haystack in [0, 1], comma-separated "
                         f"(default {EVAL_PASSKEY_DEPTHS}), or 'none' for no passkey.")
    return depths


def check_eval_flags(every: int, sequences: int | None, depths: str, evaluates: bool, method: str) -> None:
    """ValueError naming the flag and the fix for --eval-* settings no run can use (TrainConfig.check): --eval-every,
    --eval-sequences, --eval-passkey-depths as given; whether the run evaluates; --method."""
    if every < 0:
        raise ValueError(f"--eval-every {every} must be >= 0 (0: evaluate at the end only).")
    if sequences is not None and sequences < 1:
        raise ValueError(f"--eval-sequences {sequences}: evaluate at least one window (default one per DP group).")
    passkey_depths(depths)
    details = [flag for flag, default in (("--eval-sequences", sequences is None),
                                          ("--eval-passkey-depths", depths == EVAL_PASSKEY_DEPTHS)) if not default]
    if details and not evaluates:
        raise ValueError(f"{' and '.join(details)} set up an evaluation, which this run does not do: add --eval-every "
                         "N (or --eval-at-start, or --eval-data), or drop them.")
    if evaluates and method == "dpo":
        raise ValueError("--eval-* measures the next-token loss and passkey of an SFT run; a DPO run trains on pairs: "
                         "drop the --eval flags and evaluate its export with ulysses-lc-eval.")


class RunEvaluation:
    """The run's evaluation text and haystacks, built once; called after a step, it evaluates and logs.
    settings: settings.EvalSettings."""

    def __init__(self, settings, samples: list, tokenizer, seq_len: int, vocab_size: int, pad_id: int,
                 source: str):
        self.settings, self.samples, self.vocab_size, self.pad_id = settings, samples, vocab_size, pad_id
        fillers = [s.input_ids for s in samples]
        self.haystacks = build_haystacks(tokenizer, fillers, seq_len, settings.depths) if settings.depths else []
        self.source = source

    @classmethod
    def build(cls, settings, stream, stream_settings, tokenizer, layout, builder: bool, rank0: bool,
              vocab_size: int, pad_id: int) -> "RunEvaluation":
        """From --eval-data (read as --data is, with its settings), or from `stream.held_out` (the training stream
        built with held_out=settings.held_out(dp_size))."""
        seq_len = stream_settings.seq_len
        if settings.source is None:
            held = stream.held_out
            samples = [held.sample(i) for i in range(len(held))]
            source = f"{stream_settings.source}, held out after the run's windows"
        else:
            samples = eval_windows(settings.source, tokenizer, seq_len, settings.windows(layout.dp_size),
                                   shape=stream_settings.shape, cache_dir=stream_settings.cache_dir, builder=builder,
                                   progress=rank0)
            source = settings.source
        return cls(settings, samples, tokenizer, seq_len, vocab_size, pad_id, source)

    def describe(self) -> str:
        """The start-up line: when, on what, how many forwards."""
        s = self.settings
        when = (f"every {s.every} steps and " if s.every else "") + "after the last step" + \
            (", and before the first" if s.at_start else "")
        keys = f", passkey at depths {', '.join(f'{d:g}' for d in s.depths)}" if s.depths else ", no passkey"
        return (f"eval      {when}: {len(self.samples)} window(s) of {self.source}{keys} (one forward each at the "
                "step's length)")

    def __call__(self, engine, step: int, step_logger) -> EvalResult:
        """Evaluate the engine's model now (collective) and log it as step `step`'s evaluation."""
        result = evaluate(engine, self.samples, self.haystacks, pad_token_id=self.pad_id, vocab_size=self.vocab_size)
        step_logger.log_eval(step, result)
        return result


__all__ = ["EVAL_PASSKEY_DEPTHS", "RunEvaluation", "check_eval_flags", "passkey_depths"]
