"""What an evaluation found, and how it is shown: `EvalResult`, its one console line, its JSON, tables, a plot.

The same result serves the main job (one line per evaluation, a record in metrics.jsonl, TensorBoard scalars) and
`ulysses-lc-eval` (tables, a before / after comparison of two models, a PNG of loss by position).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class BucketLoss:
    """The mean loss of the rows at positions [start, end); beyond_trained: past the base model's trained length."""

    start: int
    end: int
    loss: float | None  # None: no labelled row there
    tokens: int
    beyond_trained: bool


@dataclass(frozen=True)
class PasskeyDepth:
    """The haystacks at one depth: the share of their key tokens that were the argmax (token_accuracy), of keys found
    whole (found), and the key tokens' mean log-probability."""

    depth: float
    needle_position: int  # the needle's first token, averaged over the seeds
    haystacks: int
    found: float
    token_accuracy: float
    logp: float


@dataclass(frozen=True)
class EvalResult:
    """One evaluation at `seq_len` tokens: the mean loss over every labelled row of `sequences` sequences, the same
    by position bucket, and the passkey by depth (empty when not run)."""

    seq_len: int
    loss: float | None
    tokens: int
    sequences: int
    buckets: list[BucketLoss]
    trained_length: int | None = None
    passkey: list[PasskeyDepth] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "EvalResult":
        return cls(d["seq_len"], d["loss"], d["tokens"], d["sequences"], [BucketLoss(**b) for b in d["buckets"]],
                   d.get("trained_length"), [PasskeyDepth(**p) for p in d.get("passkey", [])])

    def passkey_totals(self) -> tuple[int, int, float, float] | None:
        """(keys found, haystacks, token accuracy, mean log-probability) over every depth, or None."""
        if not self.passkey:
            return None
        n = sum(p.haystacks for p in self.passkey)
        found = round(sum(p.found * p.haystacks for p in self.passkey))
        return (found, n, sum(p.token_accuracy * p.haystacks for p in self.passkey) / n,
                sum(p.logp * p.haystacks for p in self.passkey) / n)

    def line(self, step: int | None = None) -> str:
        """One compact line: `eval step 40 | loss 3.2100 | by position 3.00 3.10 [8,192] 3.40 3.90 | passkey 4/5
        found, 92% of key tokens (logp -0.21)`; [n] marks the trained length between the buckets it separates."""
        parts = ["eval" + (f" step {step}" if step is not None else ""), f"loss {_num(self.loss, '.4f')}"]
        shown = []
        for i, b in enumerate(self.buckets):
            if b.beyond_trained and (i == 0 or not self.buckets[i - 1].beyond_trained):
                shown.append(f"[{self.trained_length:,}]")
            shown.append(_num(b.loss, ".2f"))
        parts.append("by position " + " ".join(shown))
        totals = self.passkey_totals()
        if totals is not None:
            found, n, accuracy, logp = totals
            parts.append(f"passkey {found}/{n} found, {100 * accuracy:.0f}% of key tokens (logp {logp:.2f})")
        return " | ".join(parts)

    def scalars(self) -> dict[str, float]:
        """Flat numbers for TensorBoard / W&B: eval/loss, eval/loss_pos_<start>, eval/passkey_*."""
        out = {} if self.loss is None else {"eval/loss": self.loss}
        out.update({f"eval/loss_pos_{b.start}": b.loss for b in self.buckets if b.loss is not None})
        for p in self.passkey:
            out[f"eval/passkey_found_depth_{p.depth:g}"] = p.found
            out[f"eval/passkey_logp_depth_{p.depth:g}"] = p.logp
        return out

    def table(self) -> list[str]:
        """Loss by position and passkey by depth, one row each, for a terminal."""
        mark = f" (trained length {self.trained_length:,})" if self.trained_length else ""
        lines = [f"loss {_num(self.loss, '.4f')} over {self.tokens:,} tokens of {self.sequences} sequence(s) of "
                 f"{self.seq_len:,}", f"loss by position{mark}:"]
        lines += [f"  {b.start:>10,} - {b.end:<10,} {_num(b.loss, '.4f')}{'  beyond' if b.beyond_trained else ''}"
                  for b in self.buckets]
        if self.passkey:
            lines.append("passkey by depth (needle at token; found; key tokens right; mean logp):")
            lines += [f"  depth {p.depth:<5g} at {p.needle_position:>10,}  {p.found:.2f}  {p.token_accuracy:.2f}  "
                      f"{p.logp:.3f}" for p in self.passkey]
        return lines


def compare_lines(before: EvalResult, after: EvalResult, names=("before", "after")) -> list[str]:
    """A before / after table: loss by position and passkey by depth side by side, with the change."""
    a, b = names
    lines = [f"{'':24}{a:>12}{b:>12}{'change':>10}", f"{'loss':24}{_num(before.loss, '.4f'):>12}"
             f"{_num(after.loss, '.4f'):>12}{_delta(before.loss, after.loss):>10}"]
    for x, y in zip(before.buckets, after.buckets):
        label = f"pos {x.start:,}-{x.end:,}" + (" *" if x.beyond_trained else "")
        lines.append(f"{label:24}{_num(x.loss, '.4f'):>12}{_num(y.loss, '.4f'):>12}{_delta(x.loss, y.loss):>10}")
    for x, y in zip(before.passkey, after.passkey):
        lines.append(f"{f'passkey depth {x.depth:g} found':24}{x.found:>12.2f}{y.found:>12.2f}"
                     f"{_delta(x.found, y.found):>10}")
        lines.append(f"{f'passkey depth {x.depth:g} logp':24}{x.logp:>12.3f}{y.logp:>12.3f}{_delta(x.logp, y.logp):>10}")
    if any(x.beyond_trained for x in before.buckets):
        lines.append(f"* past the trained length ({before.trained_length:,} tokens)")
    return lines


def plot(results: dict, path) -> str | None:
    """A PNG of loss by position (and the passkey's key tokens right by the key's position) for each named EvalResult; None when written, else why
    not (matplotlib is an optional extra: pip install 'ulysses_lc[plot]')."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no PNG: matplotlib is not installed (pip install 'ulysses_lc[plot]')"
    with_passkey = any(r.passkey for r in results.values())
    fig, axes = plt.subplots(1, 2 if with_passkey else 1, figsize=(11 if with_passkey else 6.5, 4), squeeze=False)
    ax = axes[0][0]
    for name, r in results.items():
        mids = [(b.start + b.end) / 2 for b in r.buckets if b.loss is not None]
        ax.plot(mids, [b.loss for b in r.buckets if b.loss is not None], marker="o", label=name)
    trained = next((r.trained_length for r in results.values() if r.trained_length), None)
    if trained:
        ax.axvline(trained, color="grey", linestyle="--", label=f"trained length {trained:,}")
    ax.set(xlabel="position (tokens)", ylabel="loss", title="loss by position")
    ax.legend()
    if with_passkey:
        ax = axes[0][1]
        for name, r in results.items():
            ax.plot([p.needle_position for p in r.passkey], [p.token_accuracy for p in r.passkey], marker="o",
                    label=name)
        if trained:
            ax.axvline(trained, color="grey", linestyle="--", label=f"trained length {trained:,}")
        ax.set(xlabel="position of the hidden key (tokens)", ylabel="key tokens right (argmax)", ylim=(-0.05, 1.05),
               title="passkey by depth")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def _num(x, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _delta(x, y) -> str:
    return "-" if x is None or y is None else f"{y - x:+.4f}"


__all__ = ["BucketLoss", "EvalResult", "PasskeyDepth", "compare_lines", "plot"]
