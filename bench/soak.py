#!/usr/bin/env python3
"""A fault soak of `comb serve` on loopback: mixed traffic from several tenants for MINUTES, clients
that leave mid-stream, Redis stopped and started again, the server killed (SIGKILL) and started
again on the same --cache-dir. Afterwards every uploaded document must be listed for its tenant and
answer as it did when uploaded (greedy), and no request may have failed for a reason other than the
faults injected.

usage: bench/soak.py [--minutes M] [COMB_BINARY]   (default 10 minutes, build/comb)
Needs redis-server ($COMB_REDIS_SERVER or on PATH). Prints a markdown table (docs/building.md).
"""
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

args = sys.argv[1:]
minutes = 10.0
if args and args[0] == "--minutes":
    minutes, args = float(args[1]), args[2:]
COMB = args[0] if args else "build/comb"
REDIS = os.environ.get("COMB_REDIS_SERVER") or shutil.which("redis-server")
TMP = tempfile.mkdtemp(prefix="comb-soak-")
CACHE = os.path.join(TMP, "cache")
lock = threading.Lock()
stats = {"requests": 0, "ok": 0, "faults": 0, "failed_in_fault": 0, "failed_other": 0, "left_midstream": 0,
         "changed_answers": 0}
failures = []
peak_rss = [0.0]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Redis:
    def __init__(self):
        self.port = free_port()
        self.proc = None

    def start(self):
        self.proc = subprocess.Popen([REDIS, "--port", str(self.port), "--save", "", "--appendonly", "no",
                                      "--dir", TMP], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.3)

    def stop(self):
        if self.proc:
            self.proc.kill()
            self.proc.wait()


class Server:
    def __init__(self, redis_port):
        self.redis_port = redis_port
        self.proc = None
        self.port = None

    def start(self):
        pf = os.path.join(TMP, f"port-{time.time()}")
        self.log = open(os.path.join(TMP, "server.log"), "a")
        self.proc = subprocess.Popen([COMB, "serve", "--port", "0", "--port-file", pf, "--threads", "2",
                                      "--cache-dir", CACHE, "--cache-url", f"redis://127.0.0.1:{self.redis_port}",
                                      "--max-running", "4", "--log-requests", "0"],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        for _ in range(600):
            if os.path.exists(pf):
                break
            time.sleep(0.1)
        self.port = int(open(pf).read())

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(120)

    def rss(self):
        try:
            for line in open(f"/proc/{self.proc.pid}/status"):
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return 0


def http(server, method, path, body=None, timeout=300, leave_after=None):
    data = json.dumps(body).encode() if body is not None else b""
    head = (f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as c:
        c.sendall(head + data)
        out = b""
        while True:
            got = c.recv(65536)
            if not got:
                break
            out += got
            if leave_after and len(out) >= leave_after:
                return 0, b""  # the client goes away
    status = int(out[9:12]) if out.startswith(b"HTTP/1.1 ") else 0
    body = out.split(b"\r\n\r\n", 1)[-1]
    if b"transfer-encoding: chunked" in out.split(b"\r\n\r\n", 1)[0].lower():
        parts, rest = [], body
        while rest:
            size, _, rest = rest.partition(b"\r\n")
            n = int(size or b"0", 16)
            if n == 0:
                break
            parts.append(rest[:n])
            rest = rest[n + 2:]
        body = b"".join(parts)
    return status, body


def chat(server, model, salt, question, docs, stream=False, leave_after=None):
    b = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 8, "temperature": 0,
         "documents": docs, "cache_salt": salt, "stream": stream}
    st, body = http(server, "POST", "/v1/chat/completions", b, leave_after=leave_after)
    if st != 200 or stream:
        return st, None
    try:
        return st, json.loads(body)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise RuntimeError(f"status 200 with a body that is not a completion: {body[:160]!r}")


def main():
    redis, rng = Redis(), random.Random(7)
    redis.start()
    server = Server(redis.port)
    server.start()
    model = json.loads(http(server, "GET", "/v1/models")[1])["data"][0]["id"]
    tenants = [f"tenant-{i}" for i in range(4)]
    uploaded = {}  # (salt, id) -> (question, answer when uploaded)
    in_fault = threading.Event()
    stop_at = time.time() + minutes * 60
    n_uploads = [0]

    def worker(seed):
        r = random.Random(seed)
        while time.time() < stop_at:
            salt = r.choice(tenants)
            kind = r.random()
            fault_before = in_fault.is_set()
            try:
                if kind < 0.25:  # upload a new document, remember its answer
                    with lock:
                        n_uploads[0] += 1
                        k = n_uploads[0]
                    text = f"Record {k}: the lock keeper of gate {k % 17} counted {k * 7 % 101} barges on day {k}."
                    st, body = http(server, "POST", "/v1/documents", {"text": text, "cache_salt": salt})
                    ok = st == 200
                    if ok:
                        doc = json.loads(body)["id"]
                        q = f"How many barges did the keeper of gate {k % 17} count on day {k}?"
                        st2, answer = chat(server, model, salt, q, [{"id": doc}])
                        if st2 == 200:
                            with lock:
                                uploaded[(salt, doc)] = (q, answer)
                elif kind < 0.55 and uploaded:  # ask an uploaded document again: the same answer
                    with lock:
                        key = r.choice([k for k in uploaded if k[0] == salt] or list(uploaded))
                        q, answer = uploaded[key]
                    st, got = chat(server, model, key[0], q, [{"id": key[1]}])
                    ok = st == 200
                    if ok and got != answer:
                        with lock:
                            stats["changed_answers"] += 1
                            failures.append(f"changed answer for {key}: {answer!r} -> {got!r}")
                elif kind < 0.8:  # documents inline
                    st, _ = chat(server, model, salt, "What did the note say?",
                                 [{"text": f"Note {r.randrange(1000)}: the ferry leaves at {r.randrange(24)}:00."}])
                    ok = st == 200
                else:  # a stream left after its first bytes
                    chat(server, model, salt, "Tell a long story.", [{"text": "A story about a ferry."}], stream=True,
                         leave_after=200)
                    with lock:
                        stats["left_midstream"] += 1
                    ok = True
            except OSError:
                ok = False
            except RuntimeError as e:
                ok = False
                with lock:
                    failures.append(str(e))
            with lock:
                stats["requests"] += 1
                if ok:
                    stats["ok"] += 1
                elif fault_before or in_fault.is_set():
                    stats["failed_in_fault"] += 1
                else:
                    stats["failed_other"] += 1
            peak_rss[0] = max(peak_rss[0], server.rss())

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    next_fault, which = time.time() + 30, 0
    while time.time() < stop_at:
        time.sleep(1)
        if time.time() >= next_fault and time.time() < stop_at - 20:
            in_fault.set()
            if which % 2 == 0:  # Redis away for 10 s
                redis.stop()
                time.sleep(10)
                redis.start()
            else:  # the server killed and started again on the same --cache-dir
                server.kill()
                server.start()
            with lock:
                stats["faults"] += 1
            time.sleep(3)
            in_fault.clear()
            which += 1
            next_fault = time.time() + 60
    for t in threads:
        t.join()
    # Afterwards, on a fresh start: every upload listed for its tenant and answering as before.
    server.stop()
    server.start()
    lost, changed = 0, 0
    for salt in tenants:
        st, body = http(server, "GET", f"/v1/documents?cache_salt={salt}")
        listed = {d["id"] for d in json.loads(body)["data"]}
        for (s, doc), (q, answer) in uploaded.items():
            if s != salt:
                continue
            if doc not in listed:
                lost += 1
                continue
            st, got = chat(server, model, salt, q, [{"id": doc}])
            changed += got != answer
    corrupt = [l for l in http(server, "GET", "/metrics")[1].decode().splitlines() if l.startswith("comb_cache_corrupt")]
    code = server.stop()
    redis.stop()
    print(f"| minutes | requests | answered | failed during a fault | failed otherwise | streams left | faults (Redis "
          f"stopped, server killed) | uploads | lost | answers changed (during, after) | corrupt entries | peak RSS (MiB) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    print(f"| {minutes:g} | {stats['requests']} | {stats['ok']} | {stats['failed_in_fault']} | {stats['failed_other']} | "
          f"{stats['left_midstream']} | {stats['faults']} | {len(uploaded)} | {lost} | {stats['changed_answers']}, "
          f"{changed} | {'; '.join(corrupt) or 'none'} | {peak_rss[0]:.0f} |")
    for f in failures[:5]:
        print("-", f)
    sys.exit(0 if lost == 0 and changed == 0 and stats["failed_other"] == 0 and code == 0 else 1)


main()
