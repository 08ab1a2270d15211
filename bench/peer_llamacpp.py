"""llama.cpp (through llama-cpp-python) and comb on the same GGUF file, alternating in one run:
prefill of each prompt length and 64 decode tokens at each thread count, median tokens/s over
rounds, peak resident memory of each process, and the comb / llama.cpp ratios.

    bench/peer_llamacpp.sh            (makes .venv-peer with llama-cpp-python, then runs this)
    .venv-peer/bin/python bench/peer_llamacpp.py --comb build/comb --model M.gguf --quantize gguf

Each side runs in a fresh process per round (so peak memory is that side's alone); the prompts are
the same token ids on both sides (ordinary ids from a fixed seed), decoding feeds one token at a
time after an 18-token prompt, with no sampling on either side.
"""
import argparse
import json
import random
import statistics
import subprocess
import sys

LLAMA_SIDE = r"""
import json, random, resource, sys, time
from llama_cpp import Llama
model, threads, lengths, n_decode, repeat = sys.argv[1], int(sys.argv[2]), [int(x) for x in sys.argv[3].split(',')], int(sys.argv[4]), int(sys.argv[5])
llm = Llama(model_path=model, n_ctx=2048, n_batch=512, n_ubatch=512, n_threads=threads, n_threads_batch=threads, verbose=False)
rng = random.Random(1234)
vocab = llm.n_vocab()
def prompt(n): return [rng.randrange(1000, vocab) for _ in range(n)]
for n in lengths:
    ids = prompt(n)
    times = []
    for _ in range(repeat):
        llm.reset()
        t0 = time.perf_counter(); llm.eval(ids); times.append(time.perf_counter() - t0)
    print(json.dumps({"bench": "prefill", "tokens": n, "tokens_per_s": n / sorted(times)[len(times) // 2]}))
if n_decode > 0:
    times = []
    for _ in range(repeat):
        llm.reset(); llm.eval(prompt(18))
        steps = prompt(n_decode)
        t0 = time.perf_counter()
        for t in steps: llm.eval([t])
        times.append(time.perf_counter() - t0)
    print(json.dumps({"bench": "decode", "tokens": n_decode, "tokens_per_s": n_decode / sorted(times)[len(times) // 2]}))
print(json.dumps({"bench": "memory", "peak_resident_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def run(cmd):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    rows = {}
    for line in out.splitlines():
        if not line.startswith("{"):
            continue
        j = json.loads(line)
        if j["bench"] == "prefill" and j.get("cached", 0) == 0:
            rows[f"prefill {j['tokens']}"] = j["tokens_per_s"]
        elif j["bench"] == "decode":
            rows[f"decode {j['tokens']}"] = j["tokens_per_s"]
        elif j["bench"] == "memory":
            rows["peak MiB"] = j["peak_resident_mib"]
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--comb", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--quantize", default="gguf", help="comb's --quantize (gguf: weights as stored; none: float32)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--lengths", default="18,128,512")
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    results = {}
    for threads in [int(t) for t in a.threads.split(",")]:
        for r in range(a.rounds):
            for side in ("llama.cpp", "comb"):
                if side == "comb":
                    cmd = [a.comb, "bench", "--model", a.model, "--quantize", a.quantize, "--threads", str(threads),
                           "--prompt-tokens", a.lengths, "--decode-tokens", str(a.decode), "--repeat", str(a.repeat),
                           "--json"]
                else:
                    cmd = [sys.executable, "-c", LLAMA_SIDE, a.model, str(threads), a.lengths, str(a.decode),
                           str(a.repeat)]
                rows = run(cmd)
                print(f"[peer] threads {threads} round {r + 1} {side}: " +
                      ", ".join(f"{k} {v:.1f}" for k, v in rows.items()), file=sys.stderr, flush=True)
                for k, v in rows.items():
                    results.setdefault((threads, k), {}).setdefault(side, []).append(v)
    print(f"comb --quantize {a.quantize} against llama.cpp (llama-cpp-python), same GGUF; tokens/s (median over "
          f"{a.rounds} rounds of medians of {a.repeat}), peak resident MiB of each process\n")
    print("| threads | measure | llama.cpp | comb | comb / llama.cpp |")
    print("|---:|---|---:|---:|---:|")
    for (threads, k), sides in results.items():
        l, c = statistics.median(sides["llama.cpp"]), statistics.median(sides["comb"])
        print(f"| {threads} | {k} | {l:.1f} | {c:.1f} | {c / l:.2f} |")


if __name__ == "__main__":
    main()
