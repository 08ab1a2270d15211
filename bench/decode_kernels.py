"""Where a decoding step's GPU time goes, kernel by kernel, from an Nsight Compute report.

    ncu --profile-from-start off --clock-control none --graph-profiling node \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum -f -o step \
        build/comb bench --model DIR --device cuda --dtype bfloat16 --prompt-tokens 16 \
        --decode-tokens 4 --repeat 1 --profile 1
    ncu --import step.ncu-rep --csv --page raw --print-units base --print-kernel-base function > step.csv
    python3 bench/decode_kernels.py step.csv --steps 4 [--graph graph.csv] [--step-us US] [--tbps 4.2]

`comb bench --profile 1` opens the profiler's range around its profiled decoding steps only, so the
report holds those steps' kernels (the graph's nodes one by one with `--graph-profiling node`; with
`--graph-profiling graph`, each replay as one result: `--graph` reads such a report too). Prints, a
step's mean: each kernel's calls, time and DRAM bytes (read and written), its rate and share of
`--tbps`; the kernels' sum; with `--step-us` (the step measured without the profiler), what lies
outside the kernels (gaps between them and the host between steps).
"""
import argparse
import csv
import re
import sys
from collections import OrderedDict

TIME = "gpu__time_duration.sum"
READ = "dram__bytes_read.sum"
WRITE = "dram__bytes_write.sum"


def number(text):
    text = text.replace(",", "").strip()
    try:
        return float(text)
    except ValueError:
        return None


def read_report(path):
    """The report's results in launch order: [(kernel name and grid, ns, bytes or None)]."""
    with open(path, newline="", encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines()
    # ncu may print ==PROF== lines (or the program's output) before the table: it starts at "ID".
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        sys.exit(f"{path}: no table found (expected a header line starting with \"ID\", as "
                 "`ncu --import REPORT --csv --page raw` prints)")
    rows = list(csv.reader(lines[start:]))
    header = rows[0]
    for need in ("Kernel Name", TIME):
        if need not in header:
            sys.exit(f"{path}: no column {need!r} (found {', '.join(header)}); profile with --metrics {TIME},...")
    col = {name: header.index(name) for name in header}
    out = []
    for row in rows[1:]:
        if len(row) != len(header) or number(row[col["ID"]]) is None:
            continue  # the units line, or a broken one
        ns = number(row[col[TIME]])
        if ns is None:
            continue
        moved = None
        if READ in col and WRITE in col:
            r, w = number(row[col[READ]]), number(row[col[WRITE]])
            moved = None if r is None or w is None else r + w
        name = short_name(row[col["Kernel Name"]])
        if "Grid Size" in col:  # one kernel of several shapes (a GEMM's per projection): its grid apart
            name = f"{name} {row[col['Grid Size']].replace(' ', '')}"
        out.append((name, ns, moved))
    if not out:
        sys.exit(f"{path}: the table has no results")
    return out


def short_name(name):
    """A kernel's name without its template arguments and parameters: what groups its calls."""
    name = name.strip().replace("(anonymous namespace)::", "")
    depth, kept = 0, []
    for ch in name:  # template arguments dropped; the name ends at the first "(" outside them
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth = max(0, depth - 1)
        elif depth == 0:
            if ch == "(":
                break
            kept.append(ch)
    name = "".join(kept).strip()
    name = re.sub(r"^(void|static)\s+", "", name)
    return name[-44:] if len(name) > 44 else name


def table(results, steps, tbps, title, step_us=None):
    n = len(results)
    names = [r[0] for r in results]
    period = n // steps if steps > 0 and n % steps == 0 else 0
    same = period > 0 and all(names[i] == names[i % period] for i in range(n))
    print(f"{title}: {n} results over {steps} steps", end="")
    if same:
        print(f", {period} a step, the same kernels in the same order each step")
    else:
        print(f"; not {steps} equal steps of the same kernels (a step's mean is still printed)")
    groups = OrderedDict()
    for name, ns, moved in results:
        g = groups.setdefault(name, [0, 0.0, 0.0, True])
        g[0] += 1
        g[1] += ns
        if moved is None:
            g[3] = False
        else:
            g[2] += moved
    total_ns = sum(g[1] for g in groups.values())
    have_bytes = all(g[3] for g in groups.values())
    print(f"  {'kernel':<60} {'calls':>6} {'us':>9} {'share':>6}" + (f" {'MB':>8} {'GB/s':>7} {'of limit':>8}" if have_bytes else ""))
    for name, (calls, ns, moved, _) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        line = f"  {name:<60} {calls / steps:>6.1f} {ns / steps / 1e3:>9.1f} {100 * ns / total_ns:>5.1f}%"
        if have_bytes:
            rate = moved / ns  # bytes per ns = GB/s
            line += f" {moved / steps / 1e6:>8.2f} {rate:>7.0f} {100 * rate / (tbps * 1e3):>7.0f}%"
        print(line)
    line = f"  {'every kernel':<60} {n / steps:>6.1f} {total_ns / steps / 1e3:>9.1f} {100:>5.1f}%"
    if have_bytes:
        moved = sum(g[2] for g in groups.values())
        line += f" {moved / steps / 1e6:>8.2f} {moved / total_ns:>7.0f} {100 * moved / total_ns / (tbps * 1e3):>7.0f}%"
    print(line)
    if step_us:
        own = total_ns / steps / 1e3
        print(f"  a step measured without the profiler: {step_us:.1f} us; its kernels' own time {own:.1f} us "
              f"({100 * own / step_us:.0f}%); outside them (gaps between kernels, the host between steps): "
              f"{step_us - own:.1f} us")
    return total_ns / steps


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("report", help="ncu --import REPORT --csv --page raw --print-units base, graph nodes one by one")
    ap.add_argument("--steps", type=int, required=True, help="decoding steps the report holds (--decode-tokens)")
    ap.add_argument("--graph", help="the same steps profiled with --graph-profiling graph (each replay one result)")
    ap.add_argument("--step-us", type=float, help="a step's time measured without the profiler, in microseconds")
    ap.add_argument("--tbps", type=float, default=4.2, help="the memory bandwidth the shares are of, TB/s (default 4.2)")
    args = ap.parse_args()
    if args.steps <= 0:
        sys.exit(f"--steps: expected a number of steps > 0, found {args.steps}")
    if args.tbps <= 0:
        sys.exit(f"--tbps: expected a rate > 0, found {args.tbps}")
    table(read_report(args.report), args.steps, args.tbps, "kernels (graph nodes one by one)", args.step_us)
    if args.graph:
        table(read_report(args.graph), args.steps, args.tbps, "replays (each graph one result)", args.step_us)


if __name__ == "__main__":
    main()
