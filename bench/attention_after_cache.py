"""Why rows after a cache attend in two parts: LibTorch's CPU attention kernel, timed on the shapes
of the default model (9 query heads, 3 KV heads, head_dim 64) for N new rows after S cached ones.

    .venv/bin/python bench/attention_after_cache.py --threads 1 --cached 60 --rows 1227

Prints one layer's attention time (median of --repeat runs) for:
  causal      a causal prefill of all S + N rows (what a full prefill runs);
  masked      the N rows in one call with a boolean mask (query j sees keys 0..S+j);
  two parts   the N rows against the S cached keys without a mask, and against their own keys
              causally, merged by log-sum-exp (what src/decoder.cpp's attend_after_cache does),
and the largest difference between the masked and the two-part outputs.
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def median_ms(fn, repeat):
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cached", type=int, default=60)
    ap.add_argument("--rows", type=int, default=1227)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=7)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    s, n, total = a.cached, a.rows, a.cached + a.rows
    groups = a.heads // a.kv_heads
    q_all = torch.randn(1, a.heads, total, a.head_dim)
    k = torch.randn(1, a.kv_heads, total, a.head_dim)
    v = torch.randn(1, a.kv_heads, total, a.head_dim)
    q = q_all[:, :, s:]
    mask = torch.arange(total).unsqueeze(0) <= torch.arange(s, total).unsqueeze(1)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

    def causal():
        return F.scaled_dot_product_attention(q_all, k, v, is_causal=True, enable_gqa=True)

    def masked():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    def two_parts():
        kr, vr = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        old_out, old_lse = flash(q, kr[:, :, :s], vr[:, :, :s], 0.0, False)
        new_out, new_lse = flash(q, kr[:, :, s:], vr[:, :, s:], 0.0, True)
        lse = torch.logaddexp(old_lse, new_lse)
        return old_out * (old_lse - lse).exp().unsqueeze(-1) + new_out * (new_lse - lse).exp().unsqueeze(-1)

    with torch.inference_mode():
        diff = (masked() - two_parts()).abs().max().item()
        print(f"torch {torch.__version__}, {a.threads} thread(s), {n} rows after {s} cached, "
              f"{a.heads}/{a.kv_heads} heads, head_dim {a.head_dim}; one layer, median of {a.repeat}")
        print(f"causal prefill of all {total} rows: {median_ms(causal, a.repeat):8.1f} ms")
        print(f"masked, one call:                {median_ms(masked, a.repeat):8.1f} ms")
        print(f"two parts, merged:               {median_ms(two_parts, a.repeat):8.1f} ms")
        print(f"max |masked - two parts|:        {diff:.2e}")


if __name__ == "__main__":
    main()
