"""Greedy answers of every caching method through the three front doors (`comb eval`, `comb serve`,
`comb generate`), checked two ways:

  1. against each other: the server, answering the same documents and question as `comb eval`,
     writes the same text for every method (one prompt builder, one decoder behind both), whether
     its requests run one at a time or batched together;
  2. against a recorded file (tests/greedy/recorded.txt): the same text as the build that recorded
     it, so that a change meant to keep behaviour (a refactor) shows any token it changed. The
     recorded file holds the CPU's vector-instruction level it was made on; on another level
     (rounding differs, greedy text may too) that comparison is skipped and said so.

usage: same_tokens.py COMB_BINARY WORK_DIR [--record]
  the model: $COMB_MODEL; the plug-in: $COMB_SHIPPED_PLUGIN (both set by the test suite);
  COMB_SAME_TOKENS_DEVICE (default cpu): the device every front door runs on (float32; on another
  than the CPU the recorded file, made on a CPU, is not compared); COMB_SAME_TOKENS_LAYERS (default
  4,12,20): the fresh plug-ins' cross layers (fewer for a model of fewer layers)
"""
import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

COMB, WORK = sys.argv[1], sys.argv[2]
RECORD = "--record" in sys.argv[3:]
RECORDED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "recorded.txt")
PLUGIN = os.environ["COMB_SHIPPED_PLUGIN"]
METHODS = ["full", "prefix", "naive", "cacheblend", "epic", "comb"]
DEVICE = os.environ.get("COMB_SAME_TOKENS_DEVICE", "cpu")
ON = ["--device", DEVICE] if DEVICE != "cpu" else []
ITEMS, TOKENS = 4, 12
failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)


def run(*args):
    p = subprocess.run([COMB, *args], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"comb {' '.join(args)} failed ({p.returncode}):\n{p.stderr}")
    return p.stdout


def cpu_level():
    flags = ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                flags = line
                break
    except OSError:
        pass
    for level in ("avx512f", "avx2", "avx"):
        if f" {level} " in flags + " ":
            return level
    return "other"


os.makedirs(WORK, exist_ok=True)
data = os.path.join(WORK, "items.jsonl")
run("make-data", "--split", "test", "--items", str(ITEMS), "--seed", "7", "--out", data)
items = [json.loads(line) for line in open(data)]
lines = []  # what is compared with the recorded file

# ---- comb eval: every method, its warm answer (after a priming request for prefix) ---------------
by_eval = {}
for m in METHODS:
    out = os.path.join(WORK, f"eval-{m}.jsonl")
    run("eval", "--method", m, "--data", data, "--max-new-tokens", str(TOKENS), "--plugin", PLUGIN, "--threads", "2",
        *ON, "--out", out)
    rows = [json.loads(line) for line in open(out)]
    check(len(rows) == ITEMS, f"eval {m}: {len(rows)} items answered of {ITEMS}")
    for r in rows:
        by_eval[(m, r["index"])] = r["prediction"]
        lines.append(f"eval {m} {r['index']} {json.dumps(r['prediction'])}")

# ---- fresh plug-ins of the other layouts (comb plugin init, no randomness): residual cross blocks,
# joint blocks reading each document as linked, joint blocks with the documents in a row --------
LAYERS = ["--cross-layers", os.environ.get("COMB_SAME_TOKENS_LAYERS", "4,12,20")]
LAYOUTS = {"reads": ["--init", "reads", *LAYERS], "joint": ["--init", "joint", *LAYERS],
           "joint-consecutive": ["--init", "joint", *LAYERS, "--consecutive-documents", "1"]}
plugins = {"shipped": PLUGIN}
for name, how in LAYOUTS.items():
    plugins[name] = os.path.join(WORK, f"plugin-{name}.safetensors")
    run("plugin", "init", *how, "--out", plugins[name])
    out = os.path.join(WORK, f"eval-comb-{name}.jsonl")
    run("eval", "--method", "comb", "--data", data, "--max-new-tokens", str(TOKENS), "--plugin", plugins[name],
        "--threads", "2", *ON, "--out", out)
    for r in (json.loads(line) for line in open(out)):
        by_eval[(f"comb-{name}", r["index"])] = r["prediction"]
        lines.append(f"eval comb-{name} {r['index']} {json.dumps(r['prediction'])}")

# ---- comb generate: the decoder alone, and two documents through the plug-in ---------------------
g = json.loads(run("generate", "--prompt", "What is the capital of France?", "--max-tokens", str(TOKENS), "--json", *ON))
lines.append(f"generate plain {json.dumps(g['tokens'])}")
docs = []
for k, d in enumerate(items[0]["documents"][:3]):
    path = os.path.join(WORK, f"doc{k}.txt")
    with open(path, "w") as f:
        f.write(d["text"])
    docs += ["--document", path]
g = json.loads(run("generate", "--plugin", PLUGIN, *docs, "--prompt", items[0]["question"], "--max-tokens", str(TOKENS),
                   "--json", "--cache-mb", "64", *ON))
lines.append(f"generate documents {json.dumps(g['tokens'])}")

# ---- comb serve: the same items as eval, one at a time and all at once ---------------------------
def serve(plugin, methods, label):
    tmp = tempfile.mkdtemp(prefix="comb-same-")
    if not os.environ.get("COMB_KEEP_TEST_DIRS"):
        atexit.register(shutil.rmtree, tmp, True)
    port_file = os.path.join(tmp, "port")
    log = open(os.path.join(tmp, "log"), "w+", errors="replace")
    server = subprocess.Popen([COMB, "serve", "--port", "0", "--port-file", port_file, "--threads", "2",
                               "--plugin", plugin, *ON], stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(600):
            if os.path.exists(port_file) or server.poll() is not None:
                break
            time.sleep(0.1)
        if not os.path.exists(port_file):
            log.seek(0)
            raise RuntimeError("the server did not start:\n" + log.read())
        base = f"http://127.0.0.1:{int(open(port_file).read())}"
        with urllib.request.urlopen(base + "/v1/models", timeout=60) as r:
            served = json.load(r)["data"][0]["id"]

        def ask(item, method):
            body = {"model": served, "messages": [{"role": "user", "content": item["question"]}],
                    "max_tokens": TOKENS, "temperature": 0, "method": method, "documents": item["documents"]}
            req = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=600) as r:
                    return json.load(r)["choices"][0]["message"]["content"]
            except urllib.error.HTTPError as e:
                raise RuntimeError(f"{method}: HTTP {e.code}: {e.read().decode(errors='replace')}") from None

        for m in methods:
            key = m if label == "shipped" else f"{m}-{label}"
            alone = [ask(item, m) for item in items]
            together = [None] * ITEMS

            def one(k):
                together[k] = ask(items[k], m)

            threads = [threading.Thread(target=one, args=(k,)) for k in range(ITEMS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for k in range(ITEMS):
                check(alone[k] == together[k], f"serve {key} item {k}: the same alone and in a batch of {ITEMS} "
                      f"({alone[k]!r} / {together[k]!r})")
                check(alone[k] == by_eval[(key, k)], f"serve {key} item {k}: the same as comb eval "
                      f"({alone[k]!r} / {by_eval[(key, k)]!r})")
                lines.append(f"serve {key} {k} {json.dumps(alone[k])}")
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)


serve(PLUGIN, METHODS, "shipped")
for name in LAYOUTS:
    serve(plugins[name], ["comb"], name)

# ---- the recorded file ---------------------------------------------------------------------------
level = cpu_level()
if DEVICE != "cpu":
    print(f"skip the recorded file: made on a CPU, these answers on {DEVICE}")
    if RECORD:
        failures.append("--record on a device other than the CPU")
elif RECORD:
    with open(RECORDED, "w") as f:
        f.write(f"# cpu {level}\n")
        f.write("\n".join(lines) + "\n")
    print(f"recorded {len(lines)} lines to {RECORDED}")
else:
    recorded = open(RECORDED).read().splitlines()
    if recorded[0] != f"# cpu {level}":
        print(f"skip the recorded file: made on '{recorded[0][2:]}', this CPU is '{level}'")
    else:
        want = recorded[1:]
        check(len(want) == len(lines), f"{len(lines)} answers, {len(want)} recorded")
        for got, exp in zip(lines, want):
            check(got == exp, f"as recorded: {exp}" + ("" if got == exp else f"\n     found:       {got}"))

print("all passed" if not failures else f"{len(failures)} failed")
sys.exit(1 if failures else 0)
