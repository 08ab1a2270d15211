#!/usr/bin/env python3
"""Hostile input classes against comb's readers and server, one table: for each class, how many
trials, how many ended in a clean error or a correct answer, crashes (a signal), hangs (past the
time bound) and the peak resident memory of the process that read the input.

usage: bench/reliability.py [COMB_BINARY [PARTS]]   (default build/comb; the model: $COMB_MODEL or the default)
PARTS: a comma-separated choice of readers, server, delay, leave, disk (default: all of them).
Prints a markdown table (docs/building.md, "Reliability"). Runs on loopback; about 5 minutes.
"""
import json
import os
import select
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

    def chat_body(self, *a, **k):
        """chat_body() with this server's model name."""
        if not hasattr(self, "model"):
            self.model = json.loads(self.request("GET", "/v1/models")[1])["data"][0]["id"]
        return {**chat_body(*a, **k), "model": self.model}

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
        body = s.chat_body

        # Slow headers: 200 connections sending a header line every 2 s, /health from another address.
        conns = []
        t_first = time.time()
        for _ in range(200):
            c = socket.create_connection(("127.0.0.1", s.port), timeout=5)
            c.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            conns.append(c)
        stop = threading.Event()

        def dribble():
            i = 0
            while not stop.wait(2.0):
                for c in conns:
                    try:
                        c.sendall(b"X-Slow-%d: y\r\n" % i)
                    except OSError:
                        pass
                i += 1

        threading.Thread(target=dribble, daemon=True).start()
        times = []
        for _ in range(5):
            t0 = time.time()
            s.raw(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", source="127.0.0.2")
            times.append(time.time() - t0)
            time.sleep(0.5)
        # Each connection's answer and when it closed, from the first byte sent.
        data = {c: b"" for c in conns}
        closed = {}
        while len(closed) < len(conns) and time.time() - t_first < 30:
            ready, _, _ = select.select([c for c in conns if c not in closed], [], [], 1.0)
            for c in ready:
                try:
                    got = c.recv(4096)
                except OSError:
                    got = b""
                if got:
                    data[c] += got
                else:
                    closed[c] = time.time() - t_first
        stop.set()
        for c in conns:
            c.close()
        statuses = {}
        for c in conns:
            st = data[c][9:12].decode(errors="replace") if data[c].startswith(b"HTTP/1.1 ") else "none"
            statuses[st] = statuses.get(st, 0) + 1
        last = max(closed.values()) if closed else float("inf")
        outcomes = ["ok" if t < 1 else "hang" for t in times] + ["ok" if len(closed) == len(conns) and last < 15 else "hang"]
        row(f"200 connections sending a header line every 2 s; /health from another address meanwhile (max "
            f"{max(times) * 1e3:.1f} ms); {len(closed)} of 200 closed by the server within {last:.1f} s of their first byte "
            f"(answers: {', '.join(f'{k}: {v}' for k, v in sorted(statuses.items()))})",
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

    finally:
        s.stop()


def delay_class(method):
    """A 6,000-token document computed while a 16-token request runs beside it."""
    s = Server("--method", method)
    try:
        def long_text(n):  # about 6,000 tokens, a different text each time (never cached)
            return " ".join(f"Entry {i}: the harbor master {n} logged {i * 13 % 97} boats in the morning fog."
                            for i in range(300))

        def short():
            t0 = time.time()
            st, _ = s.request("POST", "/v1/chat/completions", s.chat_body("Say hello.", max_tokens=16))
            return st, time.time() - t0

        def long_request(n, out):
            t0 = time.time()
            b = s.chat_body("How many boats?", [{"text": long_text(n)}], max_tokens=4)
            out["status"] = s.request("POST", "/v1/chat/completions", b)[0]
            out["seconds"] = time.time() - t0

        alone = [short()[1] for _ in range(3)]
        long_alone = {}
        long_request(0, long_alone)
        beside, long_beside, outcomes = [], [], []
        for trial in range(1, 4):  # the short request sent 1 s after the long one, while its document is computed
            out = {}
            t = threading.Thread(target=long_request, args=(trial, out))
            t.start()
            time.sleep(1.0)
            st, took = short()
            t.join()
            beside.append(took)
            long_beside.append(out.get("seconds", 0))
            outcomes.append("ok" if st == 200 and out.get("status") == 200 else "crash")
        peak = s.rss("VmHWM")
    finally:
        s.stop()
    # The long one alone with pieces of --prefill-chunk tokens (no time bound), as before the bound.
    s = Server("--method", method, "--piece-ms", "0")
    try:
        untimed = {}
        long_request(99, untimed)
    finally:
        s.stop()
    alone_s, beside_s = sorted(alone)[1], sorted(beside)[1]
    row(f"{method}: a 6,000-token document in one request; a 16-token request sent 1 s after it takes "
        f"{beside_s:.2f} s (median of 3; max {max(beside):.2f}) against {alone_s:.2f} s alone "
        f"({beside_s / alone_s:.2f}x, max {max(beside) / alone_s:.2f}x); the long one {sorted(long_beside)[1]:.1f} s, "
        f"alone {long_alone.get('seconds', 0):.1f} s, alone with --piece-ms 0 {untimed.get('seconds', 0):.1f} s",
        outcomes, [peak], "", expect="ok")


def leave_class(method):
    """A 6,000-token document whose client leaves, and one in flight at SIGTERM with --drain-timeout 3."""
    text = lambda n: " ".join(f"Entry {i}: the ferry master {n} logged {i * 11 % 89} crossings at dawn."
                               for i in range(300))
    s = Server("--method", method, "--drain-timeout", "3")
    try:
        b = s.chat_body("How many crossings?", [{"text": text(1)}], max_tokens=4)
        data = json.dumps(b).encode()
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\n\r\n").encode()
        c = socket.create_connection(("127.0.0.1", s.port), timeout=10)
        c.sendall(head + data)
        time.sleep(2.0)
        c.close()  # the client leaves while its document is computed
        t_left = time.time()
        cancelled = 0.0
        while time.time() - t_left < 10:
            metrics = s.request("GET", "/metrics")[1].decode()
            line = [l for l in metrics.splitlines() if l.startswith("comb_requests_cancelled_total ")]
            cancelled = float(line[0].split()[1]) if line else 0.0
            if cancelled >= 1:
                break
            time.sleep(0.1)
        stopped_after = time.time() - t_left
        # One in flight at SIGTERM.
        b2 = s.chat_body("How many crossings?", [{"text": text(2)}], max_tokens=4)
        result = {}

        def in_flight():
            result["status"] = s.request("POST", "/v1/chat/completions", b2)[0]

        t = threading.Thread(target=in_flight)
        t.start()
        time.sleep(2.0)
        t0 = time.time()
        s.proc.send_signal(signal.SIGTERM)
        code = s.proc.wait(60)
        exited_after = time.time() - t0
        t.join(10)
    finally:
        s.stop()
    row(f"{method}: a client leaving while its 6,000-token document is computed: cancelled {stopped_after:.1f} s after "
        f"it left; SIGTERM with --drain-timeout 3 while one is computed: exit {code} after {exited_after:.1f} s "
        f"(the request answered {result.get('status')})",
        ["ok" if cancelled >= 1 and stopped_after < 2 else "hang", "ok" if code == 0 and exited_after < 5 else "hang"],
        [0], "", expect="ok")


def disk_class():
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


parts = sys.argv[2].split(",") if len(sys.argv) > 2 else ["readers", "server", "delay", "leave", "disk"]
if "readers" in parts:
    reader_classes()
if "server" in parts:
    server_classes()
if "delay" in parts:
    for m in ("naive", "comb"):
        delay_class(m)
if "leave" in parts:
    for m in ("naive", "comb"):
        leave_class(m)
if "disk" in parts:
    disk_class()
print("| input class | trials | clean errors | correct answers | crashes | hangs | peak RSS (MiB) | example message |")
print("|---|---:|---:|---:|---:|---:|---:|---|")
for cls, n, err, ok, crash, hang, peak, ex in rows:
    ex = ex.replace(TMP + "/", "")  # the files' names without the throw-away directory
    print(f"| {cls} | {n} | {err} | {ok} | {crash} | {hang} | {peak:.0f} | {ex.replace('|', '/')[:120]} |")
