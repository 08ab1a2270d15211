"""Per-item agreement of `comb eval --out` files with a reference file.

usage: python3 agree.py REFERENCE FILE...

For each FILE: the items it shares with REFERENCE (by id), how many it answers right, and how many
of its predictions are the same text as REFERENCE's (docs/evaluation.md, "Centred int4 keys":
REFERENCE is the shipped plug-in's run with int8 caches).
"""
import gzip
import json
import sys


def load(path):
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        return {row["id"]: row for row in map(json.loads, f)}


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    reference = load(sys.argv[1])
    for path in sys.argv[2:]:
        rows = load(path)
        shared = [i for i in rows if i in reference]
        right = sum(bool(rows[i]["correct"]) for i in shared)
        same = sum(rows[i]["prediction"] == reference[i]["prediction"] for i in shared)
        print(f"{path.split('/')[-1]:45s} items {len(shared)}  right {right}  same as reference {same}")


if __name__ == "__main__":
    main()
