"""The gold passage's share of the predicting row's attention by its place among twenty passages.

usage: python3 attention_by_place.py BEFORE.csv NEAR.csv
Both files are `comb attention --out` rows of the same items (the plug-in before the span, then
the shipped one); `full`'s columns are taken from the first (both runs compute the same). Prints a
markdown table: means over the items of each group of places; the last column is the shipped
plug-in's mean gold share divided by the plug-in before's.
"""
import csv
import statistics
import sys


def rows(path):
    return {r["id"]: r for r in csv.DictReader(open(path))}


before, near = rows(sys.argv[1]), rows(sys.argv[2])
ids = [i for i in before if i in near]
places = [("1-7", 0, 6), ("8-14", 7, 13), ("15-19", 14, 18), ("20 (the last)", 19, 19), ("all", 0, 19)]
print("| gold passage (of 20) | items | `full`: documents | `full`: gold share | no span: documents"
      " | no span: gold share | span 1,024, near 512: documents | span 1,024, near 512: gold share"
      " | gold share, near 512 over no span |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
for name, lo, hi in places:
    group = [i for i in ids if lo <= int(before[i]["gold"]) <= hi]

    def mean(table, key):
        return statistics.mean(float(table[i][key]) for i in group)

    ratio = mean(near, "comb_gold_share") / mean(before, "comb_gold_share")
    print(f"| {name} | {len(group)} | {mean(before, 'full_documents'):.3f} | {mean(before, 'full_gold_share'):.3f}"
          f" | {mean(before, 'comb_documents'):.3f} | {mean(before, 'comb_gold_share'):.3f}"
          f" | {mean(near, 'comb_documents'):.3f} | {mean(near, 'comb_gold_share'):.3f} | {ratio:.2f} |")
