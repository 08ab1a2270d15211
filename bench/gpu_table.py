"""Reads `SHAPE SIDE {json}` lines (bench/gpu.sh) and prints the GPU tables: prefill and decode of
comb (with and without its CUDA graph) against transformers, and decode's share of the
memory-bandwidth limit (the weights' bytes read once a token, at the rate of a device-to-device copy
measured here); then, where the run has them, the caching methods' time to first token cold and
warm against `full`'s, beside the goals."""
import argparse
import json
import sys
from pathlib import Path

import torch


def copy_rate():
    """Bytes/s of a 2 GiB device-to-device copy (read and write counted), median of 5."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    times = []
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times = sorted(times[1:])
    return 2 * a.numel() / times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    rows = {}
    pic = {}  # (shape, side, method) -> the caching bench's medians
    for line in sys.stdin:
        try:  # a line cut short (a run killed while writing it) or not a measurement: left out
            shape, side, rest = line.split(" ", 2)
            r = json.loads(rest) if rest.startswith("{") else None
        except ValueError:
            r = None
        if not isinstance(r, dict):
            continue
        if r.get("bench") in ("prefill", "decode"):
            rows[(shape, side, r["bench"], r["tokens"])] = r["tokens_per_s"]
        elif r.get("bench") == "pic" and "method" in r:
            pic[(shape, side, r["method"])] = r
    rate = copy_rate()
    print(f"device: {torch.cuda.get_device_name()}, copy rate {rate / 1e12:.2f} TB/s\n")
    print("| shape | figure | comb | comb, own GEMV | comb, generic ATen | transformers | comb / transformers "
          "| comb / generic | share of limit |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for shape in dict.fromkeys(k[0] for k in rows):
        weights = sum(p.stat().st_size for p in Path(args.work, shape).glob("*.safetensors"))
        limit_ms = weights / rate * 1e3
        for (s, side, bench, tokens), tps in rows.items():
            if s != shape or side != "comb":
                continue
            hf = rows.get((shape, "transformers", bench, tokens))
            gen = rows.get((shape, "generic", bench, tokens))
            cub = rows.get((shape, "gemv", bench, tokens))
            ratio = lambda other: f"{tps / other:.2f}x" if other else "-"  # speed-up over `other`
            if bench == "decode":
                ms = 1e3 / tps
                fig = f"decode, ms/token (limit {limit_ms:.2f})"
                t = lambda r: f"{1e3 / r:.2f}" if r else "-"
                cols = [f"{ms:.2f}", t(cub), t(gen), t(hf), ratio(hf), ratio(gen), f"{limit_ms / ms:.0%}"]
            else:
                ms = tokens / tps * 1e3
                fig = f"prefill {tokens}, ms"
                t = lambda r: f"{tokens / r * 1e3:.1f}" if r else "-"
                cols = [f"{ms:.1f}", "-", t(gen), t(hf), ratio(hf), ratio(gen), "-"]
            print(f"| {shape} | {fig} | " + " | ".join(cols) + " |")
    if pic:
        print_pic(pic)


# The caching methods' goals (docs/benchmarks.md): warm TTFT of naive and COMB at most this share of
# `full`'s, cold COMB at most full's and naive at most 1.2x.
WARM_GOAL = {"1b": 0.5, "8b": 0.35}
COLD_GOAL = {"comb": 1.0, "naive": 1.2}
# A warm COMB request at most this much the prefill of its new tokens alone.
NEW_GOAL = {"comb": 1.2}


def print_pic(pic):
    print("\n| shape | method | cold TTFT | warm TTFT | warm / full | goal | cold / full | goal "
          "| warm / its new tokens' prefill | goal | cold, generic ATen | warm, generic ATen |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (shape, side, method), r in pic.items():
        if side != "comb":
            continue
        full = pic.get((shape, "comb", "full"))
        gen = pic.get((shape, "generic", method))
        warm = r["ttft_warm_ms_p50"] / full["ttft_warm_ms_p50"] if full else None
        cold = r["ttft_cold_ms_p50"] / full["ttft_cold_ms_p50"] if full else None
        wg = WARM_GOAL.get(shape) if method in ("naive", "comb") else None
        cg = COLD_GOAL.get(method)
        f = lambda x, d=2: f"{x:.{d}f}" if x is not None else "-"
        ng = NEW_GOAL.get(method)
        new = r.get("warm_over_new_prefill_p50")
        new_col = f"{new:.2f} ({r['warm_new_tokens_p50']:.0f} tokens, {r['new_prefill_ms_p50']:.1f} ms)" if new else "-"
        cols = [f"{r['ttft_cold_ms_p50']:.1f} ms", f"{r['ttft_warm_ms_p50']:.1f} ms", f(warm),
                f"<= {wg}" if wg else "", f(cold), f"<= {cg}" if cg else "", new_col, f"<= {ng}" if ng else "",
                f"{gen['ttft_cold_ms_p50']:.1f} ms" if gen else "-", f"{gen['ttft_warm_ms_p50']:.1f} ms" if gen else "-"]
        print(f"| {shape} | {method} | " + " | ".join(cols) + " |")


if __name__ == "__main__":
    main()
