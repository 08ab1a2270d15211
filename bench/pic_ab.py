"""Reads `LABEL {json}` lines (comb bench --pic-data ... --json, each line prefixed with the setting it
ran under, as bench/gpu_check.sh step 5 writes them) and prints one markdown row per setting and
method: cold and warm TTFT (medians over the items) and warm against `full`'s under the same
setting. Lines that are not such are left out (a run cut short)."""
import json
import sys


def main():
    rows = {}  # (label, method) -> the bench's medians
    for line in sys.stdin:
        label, _, rest = line.strip().partition(" ")
        try:
            r = json.loads(rest)
        except ValueError:
            continue
        if isinstance(r, dict) and r.get("bench") == "pic" and "method" in r:
            rows[(label, r["method"])] = r
    if not rows:
        print("(no measurement)")
        return
    print("| setting | method | cold TTFT | warm TTFT | warm / full |")
    print("|---|---|---:|---:|---:|")
    for (label, method), r in rows.items():
        full = rows.get((label, "full"))
        ratio = f"{r['ttft_warm_ms_p50'] / full['ttft_warm_ms_p50']:.2f}" if full else "-"
        print(f"| {label} | {method} | {r['ttft_cold_ms_p50']:.1f} ms | {r['ttft_warm_ms_p50']:.1f} ms | {ratio} |")


if __name__ == "__main__":
    main()
