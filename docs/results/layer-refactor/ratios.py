"""Medians of each build's rounds and the new/old ratio, from run.sh or run-final.sh output."""
import json
import statistics
import sys

runs = {}
for line in open(sys.argv[1]):
    if line.count(" ") < 2:
        continue  # a marker line
    build, _, rest = line.split(" ", 2)
    r = json.loads(rest)
    key = {"prefill": "prefill tokens/s", "decode": "decode tokens/s"}.get(r["bench"])
    if r["bench"] == "batch_decode":
        key = f"batch {r['batch']} tokens/s"
    if key:
        runs.setdefault(key, {}).setdefault(build, []).append(r["tokens_per_s"])
for key, by in runs.items():
    old, new = "old", [b for b in sorted(by) if b != "old"][0]
    mo, mn = statistics.median(by[old]), statistics.median(by[new])
    print(f"{key}: {old} {mo:.1f}, {new} {mn:.1f}, {new}/{old} {mn / mo:.2f}")
