"""Prefill and decode throughput of comb against Hugging Face transformers, measured in one run on
the same model file, dtype, thread count and machine. Prints a Markdown table with the ratios.

    .venv/bin/python bench/decoder_vs_transformers.py --threads 2 --dtype float32

Each side runs in its own process, one after the other, `--rounds` times (alternating); each
figure is the median over rounds of per-round medians.
"""
import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {"prefill": 1.0, "decode": 1.5}


def run(cmd):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return {(r["bench"], r["tokens"]): r["tokens_per_s"] for r in map(json.loads, out.strip().splitlines())}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--comb", default=str(ROOT / "build" / "comb"))
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompt-tokens", default="128,512,2048")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    common = ["--threads", str(args.threads), "--dtype", args.dtype, "--prompt-tokens", args.prompt_tokens,
              "--decode-tokens", str(args.decode_tokens), "--repeat", str(args.repeat)]
    if args.model:
        common += ["--model", args.model]
    comb_runs, hf_runs = [], []
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds}: comb", file=sys.stderr, flush=True)
        # float32 weights on both sides: comb's default keeps a GGUF file's weights quantized
        comb_runs.append(run([args.comb, "bench", "--json", "--quantize", "none"] + common))
        print(f"round {r + 1}/{args.rounds}: transformers", file=sys.stderr, flush=True)
        hf_runs.append(run([sys.executable, str(ROOT / "bench" / "hf_baseline.py")] + common))
    print(f"| figure | comb tokens/s | transformers tokens/s | ratio | target |")
    print(f"|---|---:|---:|---:|---:|")
    ok = True
    for key in comb_runs[0]:
        c = statistics.median(run_[key] for run_ in comb_runs)
        h = statistics.median(run_[key] for run_ in hf_runs)
        target = TARGETS[key[0]]
        ok &= c / h >= target
        print(f"| {key[0]} {key[1]} tokens | {c:.1f} | {h:.1f} | {c / h:.2f}x | {target:.1f}x |")
    print(f"\n{args.dtype}, {args.threads} threads; targets {'met' if ok else 'NOT met'}")


if __name__ == "__main__":
    main()
