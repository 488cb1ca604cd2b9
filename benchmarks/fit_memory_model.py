"""The memory model (ulysses_lc/plan/memory_model.py) against the measured peaks it is fitted to (tests/data/h200_peaks.json).

    python benchmarks/fit_memory_model.py            # each point: predicted / measured, GPU and host
    python benchmarks/fit_memory_model.py --fit      # also the device coefficients' fit, and the table with them

No GPU: arithmetic on the recorded points. The coefficients in memory_model.py are the --fit result (no point predicted
below 1.005 x its measurement), and tests/test_memory_prediction.py holds the same
table within 10%. A new measurement (benchmarks/bench_memory_ladder.py writes points in this format) goes into the
data file; --fit then says whether the coefficients still hold. The predictions are the test's own
(tests/test_memory_prediction.predict_point). Points marked `held_out` (other families: a window, sinks, MoE) are never
fitted to: they check that the model carries over to shapes it was not fitted on, and the test holds them alike.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.test_memory_prediction import POINTS, predict_point as predict  # noqa: E402  the test is the authority


def table(points) -> str:
    lines = [f"{'point':<26} {'plan':<12} {'gpu pred':>9} {'meas':>7} {'ratio':>6}  {'host pred':>9} {'meas':>7} "
             f"{'ratio':>6}"]
    for p in points:
        gpu, host = predict(p)
        lines.append(f"{p['id'] + (' (held out)' if p.get('held_out') else ''):<26} {str(p['plan']):<12} {gpu / 1e9:9.1f} {p['gpu_peak']:7.1f} "
                     f"{gpu / 1e9 / p['gpu_peak']:6.3f}  {host / 1e9:9.1f} {p['host_rss']:7.1f} "
                     f"{host / 1e9 / p['host_rss']:6.3f}")
    return "\n".join(lines)


FITTED = ("PLAIN_FIT", "SP_PLAIN_FIT", "PACKED_PLAIN_FIT", "BACKWARD_FIT", "RECOMPUTE_FIT")


def fit(points, floor: float = 1.005) -> str:
    """The device coefficients that bring every point's predicted / measured GPU peak closest to 1 while keeping
    each at least `floor`: coordinate search on a 0.01 grid from the current values (the model is a maximum of
    linear terms, so a plain least-squares solve would not see which phase peaks)."""
    from ulysses_lc import memory_model as mm

    def loss():
        ratios = np.array([predict(p)[0] / 1e9 / p["gpu_peak"] for p in points])
        return float(((ratios - 1) ** 2).sum() + 1e3 * (np.clip(floor - ratios, 0, None) ** 2).sum())

    best = loss()
    for _ in range(20):
        moved = False
        for name in FITTED:
            for delta in (-0.01, 0.01):
                old = getattr(mm, name)
                setattr(mm, name, round(old + delta, 2))
                if (trial := loss()) < best - 1e-9:
                    best, moved = trial, True
                else:
                    setattr(mm, name, old)
        if not moved:
            break
    return "fitted: " + ", ".join(f"{n} = {getattr(mm, n):.2f}" for n in FITTED) + "\n" + table(points)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fit", action="store_true")
    args = p.parse_args()
    print(table(POINTS))
    if args.fit:
        print(fit([p for p in POINTS if not p.get("held_out")]))


if __name__ == "__main__":
    main()
