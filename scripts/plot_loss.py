#!/usr/bin/env python3
"""Draws the loss curves of `comb train` runs (their loss.csv files) into one PNG.

usage: plot_loss.py --out docs/training/loss.png RUN.csv [RUN.csv ...]
Needs matplotlib (plotting only; nothing in comb needs Python at run time).
"""
import argparse
import csv
import math
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def smooth(values, window=5):
    """Running mean over the last `window` logged windows (the rows are small batches)."""
    out = []
    for i in range(len(values)):
        part = values[max(0, i - window + 1) : i + 1]
        out.append(sum(part) / len(part))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("runs", nargs="+")
    args = ap.parse_args()
    runs = []
    for path in args.runs:
        with open(path) as f:
            rows = list(csv.DictReader(f))
        if not rows:
            raise SystemExit(f"{path}: no rows")
        runs.append((path, rows))
    # A panel for the gates only when a run has gates (joint blocks have none), one for the reading
    # gap only when a run measured it (--reading-check).
    with_gates = any(not math.isnan(float(r["attn_gate_mean"])) for _, rows in runs for r in rows)
    with_gap = any(not math.isnan(float(r.get("ce_swapped") or "nan")) for _, rows in runs for r in rows)
    n = 1 + with_gates + with_gap
    fig, axes = plt.subplots(1, n, figsize=(5.5 * n, 4), squeeze=False)
    axes = list(axes[0])
    ax_loss = axes.pop(0)
    ax_gate = axes.pop(0) if with_gates else None
    ax_gap = axes.pop(0) if with_gap else None
    has_gap = False
    for path, rows in runs:
        steps = [int(r["step"]) for r in rows]
        name = os.path.splitext(os.path.basename(path))[0]
        swapped = [float(r.get("ce_swapped") or "nan") for r in rows]
        if any(not math.isnan(v) for v in swapped):
            # A run with --reading-check: the answer loss with the example's own documents against
            # the same batch with documents swapped between examples. The gap is what reading buys.
            ce = [float(r["ce"]) for r in rows]
            line, = ax_loss.plot(steps, smooth(ce), label=f"{name}: ce, own documents")
            ax_loss.plot(steps, smooth(swapped), ":", color=line.get_color(), label=f"{name}: ce, documents swapped")
            gap = [s - c for s, c in zip(swapped, ce)]
            ax_gap.plot(steps, gap, alpha=0.3, color=line.get_color())
            ax_gap.plot(steps, smooth(gap), color=line.get_color(), label=f"{name}")
            has_gap = True
        else:
            ax_loss.plot(steps, [float(r["loss"]) for r in rows], label=name)
        gates = [float(r["attn_gate_mean"]) for r in rows]
        if ax_gate and any(not math.isnan(v) for v in gates):  # joint blocks have no gates
            ax_gate.plot(steps, gates, label=f"{name} attn")
            ax_gate.plot(steps, [float(r["mlp_gate_mean"]) for r in rows], "--", label=f"{name} mlp")
    ax_loss.set_xlabel("optimizer step")
    ax_loss.set_ylabel("answer-token cross-entropy (running mean of 5 rows)")
    ax_loss.legend(fontsize=8)
    if ax_gate:
        ax_gate.set_xlabel("optimizer step")
        ax_gate.set_ylabel("mean tanh(gate) over cross blocks")
        ax_gate.legend(fontsize=7)
    if has_gap:
        ax_gap.set_xlabel("optimizer step")
        ax_gap.set_ylabel("ce(documents swapped) - ce(own documents)")
        ax_gap.set_title("what reading its own documents is worth", fontsize=9)
        ax_gap.axhline(0, color="grey", linewidth=0.5)
        ax_gap.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=90)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
