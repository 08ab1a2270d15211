"""Two `comb serve` replicas sharing one Redis, behind HAProxy (round robin, health checks), as
docs/serving.md's deployment section sets them up: a document first used through one replica is
read from Redis by the other; tenants (cache_salt) stay apart across replicas; a replica killed
mid-run fails only its own requests in flight while the balancer sends the rest to the other;
with Redis stopped, the replicas keep answering from their own tiers.

usage: test_replicas.py COMB_BINARY REDIS_SERVER HAPROXY  (the model: $COMB_MODEL, as the other tests)
Prints the figures and "all passed" at the end.
"""
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
COMB, REDIS, HAPROXY = sys.argv[1], sys.argv[2], sys.argv[3]
sys.argv = [sys.argv[0], COMB]  # what test_server reads
import test_server as base  # noqa: E402  (its Server, chat and check)
from test_server import check, chat  # noqa: E402

import httpx2 as httpx  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TMP = tempfile.mkdtemp(prefix="comb-replicas-")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, proc, what, seconds=30):
    for _ in range(int(seconds * 10)):
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{what} did not listen on {port}")


class Redis:
    def __init__(self):
        self.port = free_port()
        self.proc = None

    def start(self):
        self.proc = subprocess.Popen([REDIS, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", TMP], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        wait_port(self.port, self.proc, "redis-server")

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)


class Balancer:
    """HAProxy from docs/deploy/haproxy.cfg, the replicas' ports filled in."""

    def __init__(self, ports):
        self.port = free_port()
        text = open(os.path.join(HERE, "..", "..", "docs", "deploy", "haproxy.cfg")).read()
        text = text.replace("127.0.0.1:8080", f"127.0.0.1:{self.port}")
        text = text.replace("127.0.0.1:8001", f"127.0.0.1:{ports[0]}").replace("127.0.0.1:8002", f"127.0.0.1:{ports[1]}")
        self.cfg = os.path.join(TMP, "haproxy.cfg")
        open(self.cfg, "w").write(text)
        self.log = open(os.path.join(TMP, "haproxy.log"), "w+")
        self.proc = subprocess.Popen([HAPROXY, "-db", "-f", self.cfg], stdout=self.log, stderr=subprocess.STDOUT)
        wait_port(self.port, self.proc, "haproxy")
        self.base = f"http://127.0.0.1:{self.port}"

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)


class Via:
    """A client of the API at `base` (a replica or the balancer), shaped as test_server's Server for chat()."""

    def __init__(self, base_url, model):
        from openai import OpenAI
        self.base = base_url
        self.model = model
        self.client = OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def metric(server, name):
    for line in httpx.get(server.base + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def main():
    redis = Redis()
    redis.start()
    url = f"redis://127.0.0.1:{redis.port}"
    a = base.Server("--method", "naive", "--cache-url", url)
    b = base.Server("--method", "naive", "--cache-url", url)
    lb = Balancer([a.port, b.port])
    figures = {}
    try:
        via_lb = Via(lb.base, a.model)
        # Round robin: requests through the balancer reach both replicas.
        before = [metric(s, "comb_requests_finished_total") for s in (a, b)]
        for _ in range(6):
            text, _, _ = chat(via_lb, "Say hello.", max_tokens=2)
        after = [metric(s, "comb_requests_finished_total") for s in (a, b)]
        spread = [int(x - y) for x, y in zip(after, before)]
        figures["round robin (A, B)"] = spread
        check(spread == [3, 3], f"6 requests through the balancer: {spread[0]} to A, {spread[1]} to B (3 each)")

        # A document first used through A is read from Redis by B.
        doc = [{"text": "The lighthouse of Orsk was painted red in 1903 by the keeper Ilse Maren."}]
        q = "Who painted the lighthouse?"
        text_a, _, usage_a = chat(a, q, doc)
        hits_b = metric(b, 'comb_cache_hits_total{tier="remote"}')
        text_b, _, usage_b = chat(b, q, doc)
        hits_b2 = metric(b, 'comb_cache_hits_total{tier="remote"}')
        computed_b = usage_b.prompt_tokens - usage_b.prompt_tokens_details.cached_tokens
        figures["document through A then B: cached tokens A, B"] = (usage_a.prompt_tokens_details.cached_tokens,
                                                                     usage_b.prompt_tokens_details.cached_tokens)
        check(hits_b2 - hits_b >= 1, f"B read the document A computed from Redis ({hits_b2 - hits_b:.0f} Redis hit)")
        check(usage_b.prompt_tokens_details.cached_tokens > usage_a.prompt_tokens_details.cached_tokens,
              f"B's request counts the document as cached ({usage_b.prompt_tokens_details.cached_tokens} cached, "
              f"{computed_b} computed; A's: {usage_a.prompt_tokens_details.cached_tokens} cached)")
        check(text_a == text_b, f"and answers as A did ({text_a!r} / {text_b!r})")

        # Tenants stay apart across replicas.
        doc2 = [{"text": "The orchard of Tamsk holds 412 pear trees and one walnut planted in 1788."}]
        q2 = "How many pear trees are there?"
        _, _, u1 = chat(a, q2, doc2, salt="tenant-one")
        hits = metric(b, 'comb_cache_hits_total{tier="remote"}')
        _, _, u2 = chat(b, q2, doc2, salt="tenant-two")
        hits_other = metric(b, 'comb_cache_hits_total{tier="remote"}') - hits
        _, _, u3 = chat(b, q2, doc2, salt="tenant-one")
        hits_same = metric(b, 'comb_cache_hits_total{tier="remote"}') - hits - hits_other
        check(hits_other == 0 and u2.prompt_tokens_details.cached_tokens < u3.prompt_tokens_details.cached_tokens,
              f"another tenant's request on B does not read tenant-one's entry ({hits_other:.0f} Redis hits, "
              f"{u2.prompt_tokens_details.cached_tokens} cached tokens)")
        check(hits_same >= 1, f"tenant-one's own request on B does ({hits_same:.0f} Redis hit, "
                              f"{u3.prompt_tokens_details.cached_tokens} cached tokens)")

        # A replica killed mid-run: only its requests in flight fail.
        results = []
        stop = threading.Event()

        def client(n):
            while not stop.is_set():
                t0 = time.time()
                try:
                    text, reason, _ = chat(via_lb, f"Count to {n}.", max_tokens=8)
                    results.append((t0, time.time(), True))
                except Exception:  # noqa: BLE001 - any failure counts
                    results.append((t0, time.time(), False))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        time.sleep(4)
        killed_at = time.time()
        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait(30)
        dead_at = time.time()  # a request begun in [killed_at, dead_at] may have reached A before it died
        time.sleep(8)
        stop.set()
        for t in threads:
            t.join(180)
        failed = [r for r in results if not r[2]]
        in_flight = [r for r in failed if r[0] <= dead_at and r[1] >= killed_at]
        later = [r for r in results if r[0] > dead_at]
        for r in failed:
            print(f"failed: begun {r[0] - killed_at:+.3f} s, ended {r[1] - killed_at:+.3f} s from the kill "
                  f"(A gone {dead_at - killed_at:.3f} s after it)")
        figures["kill: requests, failed, of them in flight at the kill, sent after"] = (
            len(results), len(failed), len(in_flight), len(later))
        check(len(failed) == len(in_flight) and len(in_flight) <= 3,
              f"A killed mid-run: {len(results)} requests, {len(failed)} failed, all of them in flight on A at the kill")
        check(len(later) >= 3 and all(r[2] for r in later),
              f"the {len(later)} requests sent after the kill were all answered (by B)")

        # Redis stopped: B answers from its own memory tier, new documents computed.
        redis.stop()
        text_b2, _, usage = chat(via_lb, q, doc)
        check(text_b2 == text_b and usage.prompt_tokens_details.cached_tokens > 0,
              f"Redis stopped: a known document answered from B's memory tier ({usage.prompt_tokens_details.cached_tokens} "
              "cached tokens)")
        text_new, reason, _ = chat(via_lb, "What color is the door?",
                                   [{"text": "The door of the mill at Varn is green and faces the river."}])
        check(reason in ("stop", "length"), f"and a new document is computed and answered ({text_new!r})")
        check(b.proc.poll() is None, "B is still running")
    finally:
        lb.stop()
        for s in (a, b):
            if s.proc.poll() is None:
                s.stop()
        redis.stop()
        if base.failures:
            print(open(lb.cfg).read())
            print(b.logs()[-3000:])
        shutil.rmtree(TMP, ignore_errors=True)
    for k, v in figures.items():
        print(f"figure: {k}: {v}")
    print(f"{len(base.failures)} failed" if base.failures else "all passed")
    sys.exit(1 if base.failures else 0)


if __name__ == "__main__":
    main()
