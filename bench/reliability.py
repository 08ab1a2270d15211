#!/usr/bin/env python3
"""Hostile input classes against comb's readers and server, one table: for each class, how many
trials, how many ended in a clean error or a correct answer, crashes (a signal), hangs (past the
time bound) and the peak resident memory of the process that read the input.

usage: bench/reliability.py [COMB_BINARY]   (default build/comb; the model: $COMB_MODEL or the default)
Prints a markdown table (docs/building.md, "Reliability"). Runs on loopback; about 3 minutes.
"""
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib

COMB = sys.argv[1] if len(sys.argv) > 1 else "build/comb"
TMP = tempfile.mkdtemp(prefix="comb-reliability-")
rows = []


def run(args, timeout=120):
    """(outcome, peak RSS MiB, stderr tail): outcome 'error' (a comb: error line), 'ok', 'crash', 'hang'."""
    p = subprocess.Popen([COMB, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    timer = threading.Timer(timeout, p.kill)
    timer.start()
    err = p.stderr.read().decode(errors="replace")
    _, status, usage = os.wait4(p.pid, 0)
    timed_out = not timer.is_alive()
    timer.cancel()
    peak = usage.ru_maxrss / 1024
    if timed_out:
        return "hang", peak, err[-200:]
    if os.WIFSIGNALED(status):
        return "crash", peak, err[-200:]
    if os.WEXITSTATUS(status) != 0:
        return ("error" if "error:" in err else "crash"), peak, err.strip().splitlines()[-1][:160] if err.strip() else ""
    return "ok", peak, ""


def row(cls, outcomes, peaks, example, expect="error"):
    good = sum(o == expect for o in outcomes)
    rows.append((cls, len(outcomes), good if expect == "error" else 0, good if expect == "ok" else 0,
                 outcomes.count("crash"), outcomes.count("hang"), max(peaks) if peaks else 0, example))


def reader_classes():
    deep = lambda d: "[" * d + "]" * d
    outcomes, peaks, ex = [], [], ""
    for d in (100, 10_000, 100_000, 1_000_000):
        for field in ("answers", "documents", "question"):
            f = os.path.join(TMP, f"deep-{field}-{d}.jsonl")
            item = {"id": "a", "question": "q", "answers": ["x"], "documents": []}
            text = json.dumps(item).replace(json.dumps(item[field]), deep(d), 1) if field != "question" else \
                json.dumps(item).replace('"q"', deep(d), 1)
            open(f, "w").write(text + "\n")
            o, p, e = run(["eval", "--method", "naive", "--data", f, "--limit", "1"])
            outcomes.append(o), peaks.append(p)
            ex = ex or e
    row("QA item nested 100 to 1,000,000 deep (answers, documents, question)", outcomes, peaks, ex)

    outcomes, peaks, ex = [], [], ""
    for d in (100, 100_000, 1_000_000):
        m = os.path.join(TMP, f"model-{d}")
        os.makedirs(m, exist_ok=True)
        hdr = b'{"model.norm.weight":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
        open(os.path.join(m, "model.safetensors"), "wb").write(struct.pack("<Q", len(hdr)) + hdr + b"\0" * 4)
        open(os.path.join(m, "config.json"), "w").write('{"model_type":"llama","rope_scaling":%s}' % deep(d))
        o, p, e = run(["generate", "--model", m, "--prompt", "hi"])
        outcomes.append(o), peaks.append(p)
        ex = ex or e
        hdr = ('{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"__metadata__":%s}' % deep(d)).encode()
        f = os.path.join(TMP, f"deep-{d}.safetensors")
        open(f, "wb").write(struct.pack("<Q", len(hdr)) + hdr + b"\0" * 4)
        o, p, e = run(["plugin", "memory", "--plugin", f])
        outcomes.append(o), peaks.append(p)
    row("config.json and safetensors header nested 100 to 1,000,000 deep", outcomes, peaks, ex)

    outcomes, peaks, ex = [], [], ""
    for mib, one_line in ((1024, True), (1024, False), (256, True)):
        f = os.path.join(TMP, f"bomb-{mib}-{one_line}.jsonl.gz")
        co = zlib.compressobj(9, zlib.DEFLATED, 31)
        out = open(f, "wb")
        line = json.dumps({"id": "a", "question": "q", "answers": ["x"], "documents": []}).encode() + b"\n"
        if one_line:
            out.write(co.compress(b'{"id":"a","question":"q","answers":["x"],"documents":[],"pad":"'))
            chunk = b" " * (1 << 20)
        else:
            chunk = line * ((1 << 20) // len(line))
        for _ in range(mib):
            out.write(co.compress(chunk))
        if one_line:
            out.write(co.compress(b'"}\n'))
        out.write(co.flush())
        out.close()
        o, p, e = run(["eval", "--method", "naive", "--data", f])
        outcomes.append(o), peaks.append(p)
        ex = ex or e
    row("gzip bombs: 1 GiB in one line, 1 GiB of valid items, 256 MiB (each about 1 MB compressed)",
        outcomes, peaks, ex)


class Server:
    def __init__(self, *extra):
        self.dir = tempfile.mkdtemp(prefix="serve-", dir=TMP)
        pf = os.path.join(self.dir, "port")
        self.log = open(os.path.join(self.dir, "log"), "w")
        self.proc = subprocess.Popen([COMB, "serve", "--port", "0", "--port-file", pf, "--threads", "2",
                                      "--log-requests", "0", *extra], stdout=self.log, stderr=subprocess.STDOUT)
        for _ in range(600):
            if os.path.exists(pf):
                break
            time.sleep(0.1)
        self.port = int(open(pf).read())

    def rss(self, field="VmRSS"):
        for line in open(f"/proc/{self.proc.pid}/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
        return 0

    def raw(self, data, source="127.0.0.1", timeout=10):
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout, source_address=(source, 0)) as c:
            c.sendall(data)
            out = b""
            try:
                while True:
                    got = c.recv(65536)
                    if not got:
                        break
                    out += got
            except socket.timeout:
                pass
        return out

    def request(self, method, path, body=None, headers=()):
        b = json.dumps(body).encode() if body is not None else b""
        head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n" \
               f"Content-Length: {len(b)}\r\n" + "".join(h + "\r\n" for h in headers) + "\r\n"
        out = self.raw(head.encode() + b, timeout=300)
        status = int(out[9:12]) if out.startswith(b"HTTP/1.1 ") else 0
        return status, out.split(b"\r\n\r\n", 1)[-1]

    def alive(self):
        return self.proc.poll() is None

    def stop(self, sig=signal.SIGTERM):
        if self.alive():
            self.proc.send_signal(sig)
            self.proc.wait(60)


def chat_body(question, docs=None, max_tokens=16, method=None):
    b = {"model": "SmolLM2-135M-Instruct.Q4_1", "messages": [{"role": "user", "content": question}],
         "max_tokens": max_tokens, "temperature": 0}
    if docs is not None:
        b["documents"] = docs
    if method:
        b["method"] = method
    return b


def server_classes():
    s = Server("--method", "naive")
    try:
        model = json.loads(s.request("GET", "/v1/models")[1])["data"][0]["id"]

        def body(*a, **k):
            b = chat_body(*a, **k)
            b["model"] = model
            return b

        # Slow headers: 200 connections dribbling header lines, /health from another address.
        conns = []
        for _ in range(200):
            c = socket.create_connection(("127.0.0.1", s.port), timeout=5)
            c.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            conns.append(c)
        times = []
        for _ in range(5):
            t0 = time.time()
            ok = s.raw(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", source="127.0.0.2")
            times.append(time.time() - t0)
            time.sleep(0.5)
        t_open = time.time()
        for c in conns:
            c.settimeout(15)
            try:
                while c.recv(4096):
                    pass
            except OSError:
                pass
            c.close()
        ended = time.time() - t_open + 2.5  # from the connections' first bytes (five checks 0.5 s apart)
        outcomes = ["ok" if t < 1 else "hang" for t in times] + ["ok" if ended < 15 else "hang"]
        row(f"200 connections sending headers a line at a time; /health from another address (max {max(times):.2f} s); "
            f"all 200 closed within {ended:.1f} s of their first byte (72 refused at once, the rest at the 10 s deadline)",
            outcomes, [s.rss("VmHWM")], "", expect="ok")

        # A 1 GB chunked body and other refused heads.
        before = s.rss()
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" \
               b"Transfer-Encoding: chunked\r\n\r\n"
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as c:
            c.sendall(head)
            c.settimeout(0.2)
            sent = 0
            try:
                while sent < (1 << 30):
                    c.sendall(b"100000\r\n" + b"[" * (1 << 20) + b"\r\n")
                    sent += 1 << 20
            except OSError:
                pass
            c.settimeout(5)
            try:
                answer = c.recv(4096)
            except OSError:
                answer = b""
        grew = s.rss() - before
        heads = [(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\n{}", 415),
                 (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nOrigin: http://evil\r\nContent-Length: 2\r\n\r\n{}", 403),
                 (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: -5\r\n\r\n", 400),
                 (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\r\n", 411),
                 (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n", 413)]
        outcomes = ["error" if answer.startswith(b"HTTP/1.1 411") else "crash"]
        for data, want in heads:
            t0 = time.time()
            out = s.raw(data)
            outcomes.append("error" if out.startswith(f"HTTP/1.1 {want}".encode()) and time.time() - t0 < 2 else "hang")
        row(f"a chunked body of 1 GB (the server grew by {grew:.0f} MiB; {sent >> 20} MiB sent before the refusal), "
            "text/plain, foreign Origin, negative, missing or 1 GB Content-Length", outcomes, [s.rss("VmHWM")],
            answer.split(b"\r\n\r\n", 1)[-1][:120].decode(errors="replace"))

        # Fields of the wrong type or not in the API.
        bad = [{"logprobs": "yes"}, {"response_format": 5}, {"top_k": -5}, {"documents": [{"id": ""}]},
               {"frequency_penalty": 1}, {"documents": [{"text": "x", "url": "y"}]}]
        outcomes = []
        for extra in bad:
            st, _ = s.request("POST", "/v1/chat/completions", {**body("hi"), **extra})
            outcomes.append("error" if st == 400 else "crash")
        row("fields the API does not have or with the wrong type (logprobs \"yes\", response_format 5, top_k, "
            "empty document id, ...)", outcomes, [s.rss("VmHWM")], "400 naming the field")

        # A 6,000-token document against a 16-token request.
        alone = []
        for _ in range(3):
            t0 = time.time()
            s.request("POST", "/v1/chat/completions", body("Say hello.", max_tokens=16))
            alone.append(time.time() - t0)
        text = " ".join(f"Entry {i}: the harbor master logged {i * 13 % 97} boats in the morning fog." for i in range(300))
        result = {}

        def long_request():
            t0 = time.time()
            result["status"] = s.request("POST", "/v1/chat/completions", body("How many boats?", [{"text": text}],
                                                                                 max_tokens=4))[0]
            result["seconds"] = time.time() - t0

        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(1.0)
        t0 = time.time()
        st, _ = s.request("POST", "/v1/chat/completions", body("Say hello.", max_tokens=16))
        beside = time.time() - t0
        t.join()
        alone_s = sorted(alone)[1]
        row(f"a 6,000-token document in one request; a 16-token request beside it takes {beside:.2f} s against "
            f"{alone_s:.2f} s alone ({beside / alone_s:.2f}x; the long one {result.get('seconds', 0):.0f} s)",
            ["ok" if st == 200 and result.get("status") == 200 else "crash"], [s.rss("VmHWM")], "", expect="ok")
    finally:
        s.stop()

    # The disk tier's budget, and uploads across a SIGKILL.
    cache = tempfile.mkdtemp(prefix="cache-", dir=TMP)
    s = Server("--method", "naive", "--cache-dir", cache, "--cache-mb", "8")
    ids = []
    try:
        for i in range(20):
            st, b = s.request("POST", "/v1/documents", {"text": f"Upload {i}: " + "the weir was raised again. " * 20,
                                                        "method": "naive"})
            ids.append(json.loads(b)["id"])
        on_disk = sum(os.path.getsize(os.path.join(cache, f)) for f in os.listdir(cache) if f.endswith(".kv"))
    finally:
        s.stop(signal.SIGKILL)
    s = Server("--method", "naive", "--cache-dir", cache, "--cache-mb", "8")
    try:
        listed = [d["id"] for d in json.loads(s.request("GET", "/v1/documents")[1])["data"]]
        st, _ = s.request("POST", "/v1/chat/completions", {**chat_body("What was raised?", [{"id": ids[-1]}]),
                                                            "model": json.loads(s.request("GET", "/v1/models")[1])["data"][0]["id"]})
    finally:
        s.stop()
    row(f"20 uploads with --cache-mb 8 ({on_disk / 2**20:.1f} MiB on disk), then SIGKILL and a restart: "
        f"{len(set(listed) & set(ids))} of {len(set(ids))} ids listed, a request by id answered",
        ["ok" if on_disk <= 8 << 20 else "crash", "ok" if set(ids) <= set(listed) else "crash",
         "ok" if st == 200 else "crash"], [0], "", expect="ok")


reader_classes()
server_classes()
print("| input class | trials | clean errors | correct answers | crashes | hangs | peak RSS (MiB) | example message |")
print("|---|---:|---:|---:|---:|---:|---:|---|")
for cls, n, err, ok, crash, hang, peak, ex in rows:
    print(f"| {cls} | {n} | {err} | {ok} | {crash} | {hang} | {peak:.0f} | {ex.replace('|', '/')[:120]} |")
