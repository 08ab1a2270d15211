#!/usr/bin/env python3
"""Draws the loss curves of `comb train` runs (their loss.csv files) into one PNG.

usage: plot_loss.py --out docs/training/loss.png RUN.csv [RUN.csv ...]
Needs matplotlib (plotting only; nothing in comb needs Python at run time).
"""
import argparse
import csv
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("runs", nargs="+")
    args = ap.parse_args()
    fig, (ax_loss, ax_gate) = plt.subplots(1, 2, figsize=(11, 4))
    for path in args.runs:
        with open(path) as f:
            rows = list(csv.DictReader(f))
        if not rows:
            raise SystemExit(f"{path}: no rows")
        steps = [int(r["step"]) for r in rows]
        name = os.path.splitext(os.path.basename(path))[0]
        ax_loss.plot(steps, [float(r["loss"]) for r in rows], label=name)
        ax_gate.plot(steps, [float(r["attn_gate_mean"]) for r in rows], label=f"{name} attn")
        ax_gate.plot(steps, [float(r["mlp_gate_mean"]) for r in rows], "--", label=f"{name} mlp")
    ax_loss.set_xlabel("optimizer step")
    ax_loss.set_ylabel("answer-token cross-entropy")
    ax_loss.legend(fontsize=8)
    ax_gate.set_xlabel("optimizer step")
    ax_gate.set_ylabel("mean tanh(gate) over cross blocks")
    ax_gate.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=90)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
