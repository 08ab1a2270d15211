"""`comb serve` checked from outside: a real server on a loopback port, called by the official
openai client (chat and completions, streamed and not, with and without documents, every caching
method), the documents API and tenancy, 16 concurrent requests against one at a time, 1,000
malformed or hostile requests, overload, a client that goes away, metrics, SIGTERM, the disk tier
across a restart.

usage: test_server.py COMB_BINARY  (the model: $COMB_MODEL, as the other tests)
"""
import json
import atexit
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

import httpx2 as httpx  # the openai client's own HTTP library
import openai
from openai import OpenAI

COMB = sys.argv[1]
NAMES = ["comb-test", "gpt-4o-mini", "smol"]  # --served-model-name: the served name, then aliases
METHODS = ["comb", "full", "prefix", "naive", "epic", "cacheblend"]
DOCS = [
    {"title": "Harbor", "text": "The harbor of Velmora was rebuilt in 1874 after a storm destroyed the old pier."},
    {"title": "Orchard", "text": "The orchard grows pears and quinces; its oldest tree was planted by Anna Lind."},
    {"title": "Bridge", "text": "The Caldon bridge has seven arches and was opened to traffic in 1921."},
]
QUESTIONS = ["When was the harbor rebuilt?", "Who planted the oldest tree?", "How many arches does the bridge have?"]
failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)


def scratch(prefix):
    """A folder of this run's own, removed at exit unless COMB_KEEP_TEST_DIRS is set."""
    d = tempfile.mkdtemp(prefix=prefix)
    if not os.environ.get("COMB_KEEP_TEST_DIRS"):
        atexit.register(shutil.rmtree, d, True)
    return d


class Server:
    def __init__(self, *extra):
        self.dir = scratch("comb-serve-")
        port_file = os.path.join(self.dir, "port")
        self.log = open(os.path.join(self.dir, "log"), "w+", errors="replace")
        plugin = ["--plugin", os.environ["COMB_SHIPPED_PLUGIN"]] if os.environ.get("COMB_SHIPPED_PLUGIN") else []
        self.proc = subprocess.Popen([COMB, "serve", "--port", "0", "--port-file", port_file, "--threads", "2", *plugin,
                                      *extra],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        for _ in range(600):
            if os.path.exists(port_file) or self.proc.poll() is not None:
                break
            time.sleep(0.1)
        if not os.path.exists(port_file):
            raise RuntimeError("the server did not start:\n" + self.logs())
        self.port = int(open(port_file).read())
        self.base = f"http://127.0.0.1:{self.port}"
        self.model = httpx.get(self.base + "/v1/models").json()["data"][0]["id"]
        self.client = OpenAI(base_url=self.base + "/v1", api_key="unused", max_retries=0, timeout=300)

    def logs(self):
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def metric(self, name):
        for line in httpx.get(self.base + "/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            return self.proc.wait(60)
        return self.proc.returncode


def chat(s, question, docs=None, method=None, stream=False, salt=None, max_tokens=12, **kw):
    extra = {}
    if docs is not None:
        extra["documents"] = docs
    if method:
        extra["method"] = method
    if salt:
        extra["cache_salt"] = salt
    args = dict(model=s.model, messages=[{"role": "user", "content": question}], max_tokens=max_tokens,
                temperature=0, extra_body=extra, **kw)
    if not stream:
        r = s.client.chat.completions.create(**args)
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage
    text, reason, usage = "", None, None
    for chunk in s.client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args):
        if chunk.usage:
            usage = chunk.usage
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
    return text, reason, usage


def test_api(s):
    models = s.client.models.list()
    check(models.data[0].id == s.model == NAMES[0], "GET /v1/models lists the served model first")
    text, reason, usage = chat(s, "What is the capital of France?")
    check(bool(text) and reason in ("stop", "length"), f"chat without documents answers: {text!r}")
    check(usage.prompt_tokens > 0 and usage.completion_tokens > 0 and
          usage.total_tokens == usage.prompt_tokens + usage.completion_tokens, "usage adds up")
    streamed, reason2, usage2 = chat(s, "What is the capital of France?", stream=True)
    check(streamed == text and reason2 == reason, "streamed chat = non-streamed chat (greedy)")
    check(usage2 is not None and usage2.completion_tokens == usage.completion_tokens, "streamed usage chunk")
    c = s.client.completions.create(model=s.model, prompt="The capital of France is", max_tokens=8, temperature=0)
    check(bool(c.choices[0].text) and c.usage.completion_tokens > 0, f"completion: {c.choices[0].text!r}")
    pieces = [ch.choices[0].text for ch in s.client.completions.create(
        model=s.model, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True) if ch.choices]
    check("".join(pieces) == c.choices[0].text, "streamed completion = non-streamed completion")
    cd = s.client.completions.create(model=s.model, prompt="Question: who planted the oldest tree?\nAnswer:",
                                     max_tokens=8, temperature=0, extra_body={"documents": DOCS})
    check(cd.usage.prompt_tokens > c.usage.prompt_tokens, "completion with documents counts their tokens")
    # Every method, with documents, streamed and not; the second request reads cached documents.
    for m in METHODS:
        a, _, u1 = chat(s, QUESTIONS[1], DOCS, method=m)
        b, _, _ = chat(s, QUESTIONS[1], DOCS, method=m, stream=True)
        c2, _, u3 = chat(s, QUESTIONS[1], list(reversed(DOCS)), method=m)
        check(a == b and bool(a), f"{m}: streamed = non-streamed: {a!r}")
        cached = u3.prompt_tokens_details.cached_tokens
        if m == "full":
            check(cached == 0, f"{m}: nothing cached ({cached})")
        elif m == "prefix":
            check(cached > 0, f"{m}: the instruction prefix from cache ({cached} of {u3.prompt_tokens})")
        else:
            check(cached >= sum(1 for _ in DOCS) * 10, f"{m}: documents from cache in another order ({cached} of {u3.prompt_tokens})")
    seeded = [s.client.chat.completions.create(model=s.model, messages=[{"role": "user", "content": "Tell me a story."}],
                                               max_tokens=10, temperature=0.9, seed=7).choices[0].message.content
              for _ in range(2)]
    check(seeded[0] == seeded[1], "sampling with a seed repeats")
    r = s.client.chat.completions.create(model=s.model, messages=[{"role": "user", "content": "Count: one two three four"}],
                                         max_tokens=30, temperature=0)
    full_text = r.choices[0].message.content
    stop = full_text[2:5]
    r2 = s.client.chat.completions.create(model=s.model, messages=[{"role": "user", "content": "Count: one two three four"}],
                                          max_tokens=30, temperature=0, stop=[stop])
    check(r2.choices[0].message.content == full_text[:full_text.find(stop)] and r2.choices[0].finish_reason == "stop",
          f"stop string {stop!r} cuts the text")


def test_documents(s):
    fresh = {"title": "Mill", "text": "The mill on the Arne river ground its last grain in 1952."}
    up = httpx.post(s.base + "/v1/documents", json=fresh).json()
    check(up["id"].startswith("doc-") and up["tokens"] > 0 and up["cached"] is False, f"upload computes its cache: {up}")
    again = httpx.post(s.base + "/v1/documents", json=fresh).json()
    check(again["id"] == up["id"] and again["cached"] is True, "the same document again: same id, from cache")
    _, _, u1 = chat(s, "When did the mill stop?", [{"id": up["id"]}])
    check(u1.prompt_tokens_details.cached_tokens >= up["tokens"], "a request naming it reads its cache")
    by_id, _, _ = chat(s, "When did the mill stop?", [{"id": up["id"]}, DOCS[0]])
    inline, _, _ = chat(s, "When did the mill stop?", [fresh, DOCS[0]])
    check(by_id == inline, "a document by id answers as the same document inline")
    listed = httpx.get(s.base + "/v1/documents").json()["data"]
    check([d["id"] for d in listed] == [up["id"]], "GET /v1/documents lists it")
    other = httpx.post(s.base + "/v1/chat/completions", json={
        "model": s.model, "messages": [{"role": "user", "content": "x"}], "documents": [{"id": up["id"]}],
        "cache_salt": "tenant-b"})
    check(other.status_code == 400 and other.json()["error"]["code"] == "document_not_found",
          "another cache_salt cannot read the document by id")
    check(httpx.get(s.base + "/v1/documents", params={"cache_salt": "tenant-b"}).json()["data"] == [],
          "another cache_salt lists nothing")
    # Caches are per salt: tenant A's documents are never served to tenant B.
    salted = [{"title": "Ledger", "text": f"The ledger of the mill records {n} sacks of flour."} for n in (314, 2718)]
    _, _, ua = chat(s, "How many sacks?", salted, salt="tenant-a")
    _, _, ua2 = chat(s, "How many sacks?", salted, salt="tenant-a")
    _, _, ub = chat(s, "How many sacks?", salted, salt="tenant-b")
    # A cold request may count cached tokens of no tenant's (a COMB plug-in's instruction, held by
    # the model for its encoder): tenant B gets exactly what a cold request gets.
    check(ua2.prompt_tokens_details.cached_tokens > ua.prompt_tokens_details.cached_tokens,
          "tenant A: cold, then its own documents from cache")
    check(ub.prompt_tokens_details.cached_tokens == ua.prompt_tokens_details.cached_tokens,
          "tenant B does not get tenant A's cached documents")
    d = httpx.delete(s.base + f"/v1/documents/{up['id']}")
    check(d.status_code == 200 and d.json()["deleted"] is True, "DELETE /v1/documents/{id}")
    check(httpx.get(s.base + f"/v1/documents/{up['id']}").status_code == 404, "then it is gone")


def test_concurrency(s):
    jobs = [(QUESTIONS[i % 3], [DOCS[(i + k) % 3] for k in range(3)], METHODS[i % 6]) for i in range(16)]
    alone = [chat(s, q, d, method=m, max_tokens=16)[0] for q, d, m in jobs]
    together = [None] * 16
    barrier = threading.Barrier(16)

    def run(i):
        q, d, m = jobs[i]
        barrier.wait()
        together[i] = chat(s, q, d, method=m, max_tokens=16, stream=(i % 2 == 0))[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    steps_before = s.metric("comb_decode_steps_total")
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    same = sum(a == b for a, b in zip(alone, together))
    check(same == 16, f"16 concurrent requests give the greedy tokens of one at a time ({same}/16)")
    batches = httpx.get(s.base + "/metrics").text
    check("comb_decode_batch_size_bucket" in batches, "batch sizes in /metrics")
    buckets = {}
    for line in batches.splitlines():
        if line.startswith("comb_decode_batch_size_bucket"):
            buckets[line.split('"')[1]] = float(line.split()[1])
    check(buckets["+Inf"] - buckets["1"] > 0, f"steps with more than one sequence happened ({buckets})")


def test_api_extras(s):
    """logprobs and top_logprobs, /tokenize and /detokenize, n > 1 refused, the served name's aliases."""
    names = [m.id for m in s.client.models.list().data]
    check(names == NAMES, f"GET /v1/models lists the served name, then its aliases ({names})")
    for alias in NAMES[1:]:
        r = s.client.chat.completions.create(model=alias, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
        check(r.model == NAMES[0] and r.choices[0].message.content is not None,
              f"a request naming the alias {alias!r} is answered as {r.model!r}")
    # Chat: each token's log-probability and its 4 most likely alternatives, streamed and not alike.
    q = [{"role": "user", "content": "What is the capital of France?"}]
    r = s.client.chat.completions.create(model=s.model, messages=q, max_tokens=10, temperature=0, logprobs=True,
                                         top_logprobs=4)
    content = r.choices[0].logprobs.content
    check(len(content) == r.usage.completion_tokens, f"one logprobs entry per token ({len(content)})")
    check(b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace") == r.choices[0].message.content,
          "the entries' bytes spell the answer")
    check(all(len(e.top_logprobs) == 4 and e.top_logprobs[0].token == e.token and e.logprob <= 0 and
              abs(e.top_logprobs[0].logprob - e.logprob) < 1e-6 and
              all(a.logprob >= b.logprob for a, b in zip(e.top_logprobs, e.top_logprobs[1:])) for e in content),
          "greedy: each token is its step's most likely, alternatives sorted, log-probabilities <= 0")
    streamed = []
    for chunk in s.client.chat.completions.create(model=s.model, messages=q, max_tokens=10, temperature=0, logprobs=True,
                                                  top_logprobs=4, stream=True):
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
            streamed += chunk.choices[0].logprobs.content
    check([(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content],
          f"streamed logprobs = non-streamed ({len(streamed)} entries)")
    plain = s.client.chat.completions.create(model=s.model, messages=q, max_tokens=4, temperature=0)
    check(plain.choices[0].logprobs is None, "no logprobs unless asked")
    # Completions: OpenAI's older form.
    c = s.client.completions.create(model=s.model, prompt="The capital of France is", max_tokens=6, temperature=0,
                                    logprobs=3)
    lp = c.choices[0].logprobs
    check(len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == c.usage.completion_tokens
          and all(len(t) <= 3 and max(t.values()) == v for t, v in zip(lp.top_logprobs, lp.token_logprobs))
          and lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0,
          f"completions logprobs: tokens, token_logprobs, top_logprobs, text_offset ({lp.tokens})")
    # /tokenize and /detokenize, checked against what the completions count.
    t = httpx.post(s.base + "/tokenize", json={"model": s.model, "prompt": "The capital of France is"}).json()
    c2 = s.client.completions.create(model=s.model, prompt=t["tokens"], max_tokens=6, temperature=0)
    check(t["count"] == len(t["tokens"]) == c.usage.prompt_tokens and c2.choices[0].text == c.choices[0].text,
          f"/tokenize gives the prompt's ids ({t['count']}), and completing them answers as the text does")
    d = httpx.post(s.base + "/detokenize", json={"tokens": t["tokens"]}).json()
    check(d["prompt"] == "The capital of France is", f"/detokenize gives the text back ({d})")
    tc = httpx.post(s.base + "/tokenize", json={"messages": q, "return_token_strs": True}).json()
    check(tc["count"] == r.usage.prompt_tokens and len(tc["token_strs"]) == tc["count"],
          f"/tokenize of messages counts the chat's prompt tokens ({tc['count']} = {r.usage.prompt_tokens})")
    tl = httpx.post(s.base + "/tokenize", json={"content": "The capital of France is"}).json()
    check(tl["tokens"] == t["tokens"], "/tokenize takes llama.cpp's 'content' too")
    for path, body, what in [("/tokenize", {}, "nothing to tokenize"),
                             ("/tokenize", {"prompt": "a", "messages": q}, "both prompt and messages"),
                             ("/tokenize", {"prompt": "a", "model": "nope"}, "unknown model"),
                             ("/detokenize", {"tokens": [10**9]}, "an id past the vocabulary"),
                             ("/detokenize", {"tokens": "1 2"}, "tokens a string"),
                             ("/v1/chat/completions", {"model": s.model, "messages": q, "n": 2}, "n = 2"),
                             ("/v1/chat/completions", {"model": s.model, "messages": q, "top_logprobs": 2}, "top_logprobs alone"),
                             ("/v1/chat/completions", {"model": s.model, "messages": q, "logprobs": True,
                                                       "top_logprobs": 21}, "21 alternatives")]:
        e = httpx.post(s.base + path, json=body)
        check(e.status_code in (400, 404) and e.json()["error"]["message"],
              f"{path} {what}: {e.status_code} {e.json()['error']['message'][:90]!r}")


def test_loadgen(s):
    """comb loadgen against this server, documents as comb's field and written into the message
    (--documents prompt, the form bench/peer_serve.sh sends llama-server)."""
    data = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "rescore.jsonl")
    for mode in ("field", "prompt"):
        out = subprocess.run([COMB, "loadgen", "--port", str(s.port), "--data", data, "--items", "3", "--rates", "4",
                              "--duration", "1", "--max-tokens", "4", "--documents", mode, "--methods",
                              "naive" if mode == "field" else "prompt", "--json"],
                             capture_output=True, text=True, timeout=300)
        rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
        ok = out.returncode == 0 and len(rows) == 1 and rows[0]["completed"] == rows[0]["sent"] and rows[0]["errors"] == 0
        check(ok, f"loadgen --documents {mode}: every request answered ({rows or out.stderr[-300:]})")
    # Closed-loop clients with plain prompts of --prompt-words words (no documents).
    out = subprocess.run([COMB, "loadgen", "--port", str(s.port), "--data", data, "--items", "3", "--concurrency", "2",
                          "--prompt-words", "30", "--duration", "1", "--max-tokens", "4", "--warm", "0", "--json"],
                         capture_output=True, text=True, timeout=300)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    ok = (out.returncode == 0 and len(rows) == 1 and rows[0]["concurrency"] == 2 and rows[0]["sent"] >= 2 and
          rows[0]["completed"] == rows[0]["sent"] and rows[0]["errors"] == 0 and rows[0]["prompt_tokens_mean"] >= 30 and
          rows[0]["method"] == "full")
    check(ok, f"loadgen --concurrency 2 --prompt-words 30: every request answered ({rows or out.stderr[-300:]})")
    out = subprocess.run([COMB, "loadgen", "--port", str(s.port), "--data", data, "--rates", "1", "--concurrency", "2"],
                         capture_output=True, text=True, timeout=60)
    check(out.returncode != 0 and "exclude each other" in out.stderr, f"loadgen: --rates with --concurrency refused ({out.stderr[-200:]!r})")


def hostile_requests(model):
    """1,000 bodies and paths, none of them valid."""
    rng = random.Random(5)
    good = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    out = []
    fixed = [
        ("POST", "/v1/chat/completions", b"{", "truncated JSON"),
        ("POST", "/v1/chat/completions", b"", "empty body"),
        ("POST", "/v1/chat/completions", b"[1,2,3]", "not an object"),
        ("POST", "/v1/chat/completions", b"\xff\xfe\x00garbage", "binary"),
        ("POST", "/v1/chat/completions", b'{"model": "' + b"\xc3\x28" + b'"}', "invalid UTF-8"),
        ("POST", "/v1/chat/completions", b"[" * 100000 + b"]" * 100000, "deep nesting"),
        ("POST", "/v1/chat/completions", b'{"max_tokens": 2e5555555555}', "a number beyond a double"),
        ("POST", "/v1/chat/completions", b'{"a":' * 50000 + b"1" + b"}" * 50000, "deep objects"),
        ("POST", "/v1/chat/completions", json.dumps({**good, "model": "gpt-4"}).encode(), "unknown model"),
        ("POST", "/v1/chat/completions", json.dumps({**good, "max_tokens": 10**30}).encode(), "huge max_tokens"),
        ("POST", "/v1/chat/completions", json.dumps({**good, "max_tokens": 10**9}).encode(), "max_tokens past the context"),
        ("POST", "/v1/chat/completions", json.dumps({**good, "max_tokens": -5}).encode(), "negative max_tokens"),
        ("POST", "/v1/chat/completions", json.dumps({**good, "max_tokens": 2.5}).encode(), "fractional max_tokens"),
        ("POST", "/v1/chat/completions", json.dumps({**good, "temperature": "hot"}).encode(), "string temperature"),
        ("POST", "/v1/chat/completions", json.dumps({**good, "temperature": 1e308}).encode(), "huge temperature"),
        ("POST", "/v1/chat/completions", json.dumps({**good, "n": 3}).encode(), "n = 3"),
        ("POST", "/v1/chat/completions", json.dumps({**good, "messages": []}).encode(), "no messages"),
        ("POST", "/v1/chat/completions", json.dumps({**good, "messages": "hi"}).encode(), "messages a string"),
        ("POST", "/v1/chat/completions", json.dumps({**good, "messages": [{"role": "robot", "content": "x"}]}).encode(), "bad role"),
        ("POST", "/v1/chat/completions", json.dumps({**good, "messages": [{"role": "user", "content": "x " * 20000}]}).encode(), "prompt past the context"),
        ("POST", "/v1/chat/completions", json.dumps({**good, "documents": [{"text": "y" * 70000}]}).encode(), "oversized document"),
        ("POST", "/v1/chat/completions", json.dumps({**good, "documents": [{"text": "d"}] * 33}).encode(), "too many documents"),
        ("POST", "/v1/chat/completions", json.dumps({**good, "documents": [{"id": "doc-nope"}]}).encode(), "unknown document"),
        ("POST", "/v1/chat/completions", json.dumps({**good, "documents": "all"}).encode(), "documents a string"),
        ("POST", "/v1/chat/completions", json.dumps({**good, "method": "magic"}).encode(), "unknown method"),
        ("POST", "/v1/chat/completions", json.dumps({**good, "stop": ["a", "b", "c", "d", "e"]}).encode(), "five stops"),
        ("POST", "/v1/chat/completions", json.dumps({**good, "stream": "yes"}).encode(), "stream a string"),
        ("POST", "/v1/chat/completions", json.dumps({**good, "seed": 1e40}).encode(), "huge seed"),
        ("POST", "/v1/completions", json.dumps({"model": model, "prompt": [10**12]}).encode(), "token id out of range"),
        ("POST", "/v1/completions", json.dumps({"model": model, "prompt": [99999999]}).encode(), "token id past the vocabulary"),
        ("POST", "/v1/completions", json.dumps({"model": model, "prompt": ["a", "b"]}).encode(), "two prompts"),
        ("POST", "/v1/completions", json.dumps({"model": model}).encode(), "no prompt"),
        ("POST", "/v1/documents", b'{"title": 5}', "document without text"),
        ("POST", "/v1/documents", json.dumps({"text": "z" * 70000}).encode(), "oversized upload"),
        ("POST", "/v1/documents", b"x" * (9 << 20), "body over the limit"),
        ("GET", "/v1/documents/doc-nope", None, "unknown document id"),
        ("DELETE", "/v1/documents/doc-nope", None, "delete unknown"),
        ("GET", "/v1/nothing", None, "unknown route"),
        ("POST", "/v1/models", b"{}", "POST to a GET route"),
        ("POST", "/tokenize", b"{}", "nothing to tokenize"),
        ("POST", "/tokenize", json.dumps({"prompt": "x" * (2 << 20)}).encode(), "a prompt over the limit"),
        ("POST", "/tokenize", json.dumps({"messages": [{"role": "user", "content": "x"}] * 300}).encode(), "300 messages"),
        ("POST", "/detokenize", json.dumps({"tokens": [-1]}).encode(), "a negative id"),
        ("POST", "/detokenize", json.dumps({"tokens": [[1]]}).encode(), "nested ids"),
    ]
    out.extend(fixed)
    # Per field, values that are never valid there.
    invalid = {
        "model": [None, 1, [], {}, "", "other-model"],
        "messages": [None, "x", [], [None], [{"role": "user"}], [{"content": 5, "role": "user"}],
                     [{"role": "robot", "content": "x"}], {}, [{"role": "user", "content": [{"type": "image"}]}]],
        "max_tokens": [0, -1, 2**63, "x", 2.5, True, [], 10**6],
        "temperature": [-1, 3, "x", [], {}, True],
        "top_p": [0, -0.5, 2, "x", []],
        "seed": [1.5, "x", 2**64, [], True],
        "stop": [5, [1], ["a"] * 5, [""], {}, True],
        "stream": ["yes", 1, [], {}],
        "documents": ["all", 5, [5], [{}], [{"text": ""}], [{"text": 5}], [{"id": 7}], [{"id": "x", "text": "y"}],
                      [{"id": ""}], [{"text": "y", "url": "z"}]],
        "method": [5, "magic", [], ""],
        "cache_salt": [5, [], {}, "s" * 300],
        "n": [2, 0, "x", 1.5],
        "stream_options": ["x", 5, {"include_usage": "yes"}],
        "logprobs": ["yes", [], -1, 21, {}],
        "top_logprobs": [-1, 21, "x", True],
        "top_k": [-5, 1, "x"],  # not a field of this API
        "response_format": [5, "json", {"type": "json_object"}],
        "frequency_penalty": [0.5, "x", 3],
        "logit_bias": [{"1": 5}, 5],
    }
    while len(out) < 1000:
        kind = rng.randrange(4)
        if kind == 0:  # a valid body with one field replaced by a wrong value
            body = dict(good)
            field = rng.choice(sorted(invalid))
            body[field] = rng.choice(invalid[field])
            raw = json.dumps(body).encode()
            out.append(("POST", rng.choice(["/v1/chat/completions", "/v1/completions"]), raw, "wrong type"))
        elif kind == 1:  # a valid body cut short
            raw = json.dumps({**good, "documents": DOCS}).encode()
            out.append(("POST", "/v1/chat/completions", raw[:rng.randrange(1, len(raw) - 1)], "truncated"))
        elif kind == 2:  # random bytes
            out.append(("POST", rng.choice(["/v1/chat/completions", "/v1/completions", "/v1/documents"]),
                        bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300))), "random bytes"))
        else:  # a valid body with its bytes flipped
            raw = bytearray(json.dumps({**good, "stop": ["\n"]}).encode())
            for _ in range(rng.randrange(1, 4)):
                raw[rng.randrange(len(raw))] = rng.randrange(256)
            try:  # a flip that leaves valid JSON may leave a valid request: only broken JSON is kept
                json.loads(bytes(raw))
                continue
            except (ValueError, UnicodeDecodeError):
                pass
            out.append(("POST", "/v1/chat/completions", bytes(raw), "flipped bytes"))
    return out[:1000]


def test_hostile(s):
    statuses = {}
    bad = []
    with httpx.Client(base_url=s.base, timeout=60) as h:
        for method, path, body, what in hostile_requests(s.model):
            try:
                r = h.request(method, path, content=body, headers={"Content-Type": "application/json"})
                code = r.status_code
                shaped = code >= 400 and "error" in r.json() and "message" in r.json()["error"]
            except Exception as e:  # noqa: BLE001 - any failure to answer counts
                code, shaped = f"no answer: {type(e).__name__}", False
            statuses[code] = statuses.get(code, 0) + 1
            if not (isinstance(code, int) and 400 <= code < 500 and shaped):
                bad.append((what, code, (body or b"")[:80]))
    print("statuses of 1,000 hostile requests:", statuses)
    check(not bad, f"1,000 hostile requests: every one a 4xx with an OpenAI-shaped error ({bad[:5]})")
    # Documents within every size bound alone, past the per-request bound together: refused before
    # anything is computed.
    many = [{"text": f"Ledger {i}: " + "the tide rose and fell again " * 170} for i in range(20)]
    t0 = time.time()
    r = httpx.post(s.base + "/v1/chat/completions", json={"model": s.model, "messages": [{"role": "user", "content": "hi"}],
                                                          "documents": many, "max_tokens": 2, "method": "comb"}, timeout=60)
    took = time.time() - t0
    check(r.status_code == 413 and "--max-request-document-tokens" in r.json()["error"]["message"] and took < 5,
          f"20 documents of about 1,000 tokens each: 413 at once ({r.status_code} in {took:.2f} s: {r.text[:160]})")
    check(s.proc.poll() is None, "the server is still running")
    text, _, _ = chat(s, "What is the capital of France?")
    check(bool(text), "a valid request afterwards succeeds")


def exchange(s, data, timeout=5):
    """Sends raw bytes on a new connection; returns all the server sends until it closes."""
    with socket.create_connection(("127.0.0.1", s.port), timeout=timeout) as c:
        c.sendall(data)
        out = b""
        while True:
            got = c.recv(65536)
            if not got:
                return out
            out += got


def raw_request(s, head, body=b"", read_s=5):
    """Sends raw bytes; returns (status, error message, seconds until the answer began)."""
    with socket.create_connection(("127.0.0.1", s.port), timeout=read_s) as c:
        t0 = time.time()
        c.sendall(head)
        if body:  # the server may answer at the headers and never read the body: sending may stall
            c.settimeout(0.5)
            try:
                c.sendall(body)
            except OSError:
                pass
            c.settimeout(read_s)
        data = b""
        try:
            while b"\r\n\r\n" not in data or len(data) < data.find(b"\r\n\r\n") + 4 + 10:
                got = c.recv(65536)
                if not got:
                    break
                data += got
        except socket.timeout:
            pass
        took = time.time() - t0
    if not data.startswith(b"HTTP/1.1 "):
        return None, "", took
    status = int(data[9:12])
    text = data.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in data else b""
    try:
        message = json.loads(text[text.find(b"{"):].decode(errors="replace"))["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = text[:200].decode(errors="replace")
    return status, message, took


def raw_hostile_requests(model):
    """500 requests as raw bytes, broken in the request line, the headers or the framing of the body
    (none of them a valid request, though a mutation may leave one that is)."""
    rng = random.Random(11)
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()

    def head(line=b"POST /v1/chat/completions HTTP/1.1", headers=None, length=True, eol=b"\r\n"):
        hs = [b"Host: x", b"Content-Type: application/json"] if headers is None else list(headers)
        if length:
            hs.append(b"Content-Length: %d" % len(body))
        return line + eol + b"".join(h + eol for h in hs) + eol

    fixed = [
        head(b"POST /v1/chat/completions HTTP/9.9") + body,
        head(b"POST /v1/chat/completions") + body,
        head(b"POST  /v1/chat/completions  HTTP/1.1") + body,
        head(b"BREW /v1/chat/completions HTTP/1.1") + body,
        head(b"post /v1/chat/completions HTTP/1.1") + body,
        head(b"POST http://evil/v1/chat/completions HTTP/1.1") + body,
        head(b"POST /v1/chat/completions?" + b"a=1&" * 20000 + b" HTTP/1.1") + body,
        head(b"GET /" + b"x" * 100000 + b" HTTP/1.1", length=False),
        head(b"GET /health\x00 HTTP/1.1", length=False),
        head(b"GET /%2e%2e/%2e%2e/etc/passwd HTTP/1.1", length=False),
        head(b"GET /v1/documents/../../etc/passwd HTTP/1.1", length=False),
        head(eol=b"\n") + body,
        head(headers=[b"Host: x", b"Content-Type: application/json", b"Content-Length: 5"]) + body,
        head(headers=[b"Host: x", b"Content-Type: application/json", b"Content-Length: 5", b"Content-Length: 7"],
             length=False) + body,
        head(headers=[b"Host: x", b"Content-Type: application/json", b"Content-Length: +12"], length=False) + body,
        head(headers=[b"Host: x", b"Content-Type: application/json", b"Content-Length: 0x10"], length=False) + body,
        head(headers=[b"Host: x", b"Content-Type: application/json", b"Content-Length: 99999999999999999999999"],
             length=False) + body,
        head(headers=[b"Host: x", b"Content-Type: application/json", b"Transfer-Encoding: gzip"]) + body,
        head(headers=[b"Host: x", b"Content-Type: application/json", b"Transfer-Encoding: chunked"], length=False)
        + b"zz\r\n" + body + b"\r\n0\r\n\r\n",
        head(headers=[b"Host: x", b"Content-Type: application/json", b"Transfer-Encoding: chunked"], length=False)
        + b"ffffffffffffffffff\r\n" + body,
        head(headers=[b"Host: x", b"Content-Type: application/json", b"Transfer-Encoding: chunked"])
        + b"%x;ext=1\r\n" % len(body) + body + b"\r\n0\r\n\r\n",
        head(headers=[b"Host: x", b"Content-Type: application/json", b" folded: line"]) + body,
        head(headers=[b"Host: x", b"Content-Type: application/json", b"no colon here"]) + body,
        head(headers=[b"Host: x", b"Content-Type: application/json", b"Bad Name: y"]) + body,
        head(headers=[b"Host: x", b"Content-Type: application/json"] + [b"X-%d: y" % i for i in range(5000)]) + body,
        head(headers=[b"Host: x", b"Content-Type: application/json", b"X-Long: " + b"y" * 70000]) + body,
        head(headers=[b"Host: x", b"Content-Type: application/json; charset=utf-16"]) + body,
        head(headers=[b"Host: x", b"Content-Type: application/json\x00text/plain"]) + body,
        head(headers=[b"Host: x", b"Content-Type: multipart/form-data; boundary=x"]) + body,
        head(headers=[b"Host: x", b"Content-Type: application/json", b"Origin: null"]) + body,
        head(headers=[b"Host: x", b"Content-Type: application/json", b"Expect: 100-continue"]) + body,
        head(headers=[b"Host: x", b"Content-Type: application/json", b"Connection: upgrade", b"Upgrade: websocket"])
        + body,
        b"\r\n" * 1000 + head() + body,
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(256)),  # a TLS client hello
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",  # an HTTP/2 preface
    ]
    out = list(fixed)
    valid = head() + body
    while len(out) < 500:
        kind = rng.randrange(4)
        raw = bytearray(valid)
        if kind == 0:  # bytes flipped in the line and headers
            end = valid.find(b"\r\n\r\n")
            for _ in range(rng.randrange(1, 5)):
                raw[rng.randrange(end)] = rng.randrange(256)
        elif kind == 1:  # a piece of the head repeated or cut out
            a, b = sorted(rng.randrange(len(valid) - len(body)) for _ in range(2))
            raw = raw[:a] + raw[a:b] * rng.randrange(0, 50) + raw[b:]
        elif kind == 2:  # a chunked body with broken framing
            sizes = [rng.choice([b"%x" % rng.randrange(1, 200), b"-1", b"", b"1 2", b"\x00", b"10000000000000000"])
                     for _ in range(rng.randrange(1, 4))]
            raw = bytearray(head(headers=[b"Host: x", b"Content-Type: application/json", b"Transfer-Encoding: chunked"],
                                 length=False))
            for sz in sizes:
                raw += sz + rng.choice([b"\r\n", b"\n", b""]) + body[:rng.randrange(len(body))] + b"\r\n"
            if rng.random() < 0.5:
                raw += b"0\r\n\r\n"
        else:  # random bytes after a plausible start
            raw = bytearray(rng.choice([b"GET ", b"POST /", b"POST /v1/documents HTTP/1.1\r\n", b""]))
            raw += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 400)))
        if bytes(raw) == valid:
            continue
        out.append(bytes(raw))
    return out


def test_raw_requests(s):
    """Raw request bytes broken at the HTTP level: each gets a 4xx or the connection closes (never a
    5xx, a hang past the request timeout or a crash); the server answers /health afterwards."""
    outcomes = {}
    bad = []
    t_all = time.time()
    for i, data in enumerate(raw_hostile_requests(s.model)):
        with socket.create_connection(("127.0.0.1", s.port), timeout=15) as c:
            t0 = time.time()
            try:
                c.sendall(data)
                c.shutdown(socket.SHUT_WR)  # nothing more comes: a request cut short ends now
            except OSError:
                pass  # refused and closed before all was sent
            got = b""
            try:
                while True:
                    piece = c.recv(65536)
                    if not piece:
                        break
                    got += piece
            except OSError:
                pass
            took = time.time() - t0
        statuses = [int(got[j + 9:j + 12]) for j in range(len(got)) if got.startswith(b"HTTP/1.1 ", j)
                    and got[j + 9:j + 12].isdigit()]
        kind = "closed" if not statuses else ",".join(str(x) for x in statuses)
        outcomes[kind] = outcomes.get(kind, 0) + 1
        if any(x >= 500 for x in statuses) or took > 12:
            bad.append((i, kind, round(took, 1), data[:60]))
    print(f"500 raw requests broken at the HTTP level ({time.time() - t_all:.1f} s): {dict(sorted(outcomes.items()))}")
    check(not bad, f"raw requests: no 5xx and none held past the request timeout ({bad[:5]})")
    check(s.proc.poll() is None, "the server is still running")
    check(httpx.get(s.base + "/health", timeout=5).status_code == 200, "and answers /health")


def test_request_heads(s):
    """What the line and headers say is checked before the body is read or waited for."""
    body = json.dumps({"model": s.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()

    def post(headers, payload=b""):
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + b"".join(h + b"\r\n" for h in headers) + b"\r\n"
        return raw_request(s, head, payload)

    length = b"Content-Length: %d" % len(body)
    code, message, took = post([b"Content-Type: text/plain", length], body)
    check(code == 415 and "application/json" in message, f"a text/plain POST (a web form) gets 415 ({code} {message})")
    code, message, took = post([b"Content-Type: application/json", b"Origin: http://evil.example", length], body)
    check(code == 403 and "evil.example" in message, f"a request from another origin gets 403 ({code} {message})")
    code, message, took = post([b"Content-Type: application/json"])
    check(code == 411 and took < 2, f"no Content-Length: 411 at once ({code} in {took:.2f} s)")
    code, message, took = post([b"Content-Type: application/json", b"Content-Length: -5"])
    check(code == 400 and took < 2, f"a negative Content-Length: 400 at once ({code} in {took:.2f} s: {message})")
    code, message, took = post([b"Content-Type: application/json", b"Content-Length: 1000000000"])
    check(code == 413 and took < 2, f"a 1 GB Content-Length: 413 before the body is sent ({code} in {took:.2f} s)")
    # A 1 GB chunked body: refused at its headers, not buffered (the first megabyte is sent, the rest
    # would follow); the server's memory does not grow by it.
    rss = lambda: int(open(f"/proc/{s.proc.pid}/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    before = rss()
    chunk = b"%x\r\n" % (1 << 20) + b"[" * (1 << 20) + b"\r\n"
    code, message, took = post([b"Content-Type: application/json", b"Transfer-Encoding: chunked"], chunk)
    check(code == 411 and took < 2, f"a chunked body of 1 GB: 411 at its headers ({code} in {took:.2f} s: {message})")
    check(rss() - before < 100 << 20, f"and the server's memory grew by {(rss() - before) >> 20} MiB (< 100)")
    # A refused body is never read as a request of its own: a form post (text/plain) whose body is a
    # request gets the 415 alone, and the connection closes.
    hidden = b"DELETE /v1/documents/doc-x HTTP/1.1\r\nHost: x\r\n\r\n"
    data = exchange(s, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\n"
                       b"Content-Length: %d\r\n\r\n" % len(hidden) + hidden)
    check(data.count(b"HTTP/1.1 ") == 1 and data.startswith(b"HTTP/1.1 415"),
          f"the body of a refused request is not run as a request ({data.count(b'HTTP/1.1 ')} answers)")
    # Three requests pipelined in one write: three answers, in order.
    data = exchange(s, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
                       b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    statuses = [int(data[i + 9:i + 12]) for i in range(len(data)) if data.startswith(b"HTTP/1.1 ", i)]
    check(statuses == [200, 200, 200] and data.find(b'"object":"list"') > data.find(b"HTTP/1.1 200", 1),
          f"pipelined requests are answered in order ({statuses})")
    r = httpx.post(s.base + "/v1/chat/completions", json={"model": s.model, "messages": [{"role": "user", "content": "hi"}],
                                                          "top_k": 5}, timeout=30)
    check(r.status_code == 400 and "'top_k'" in r.json()["error"]["message"] and r.json()["error"]["param"] == "top_k",
          f"a field the API does not have is named in a 400 ({r.status_code} {r.text[:160]})")
    text, _, _ = chat(s, "What is the capital of France?")
    check(bool(text), "a valid request afterwards succeeds")


def test_slow_clients(s):
    """200 connections that send their headers a line at a time: the ones over the per-address
    limit are refused at once, the rest cut off at the request deadline; another client is served
    meanwhile."""
    conns, refused = [], 0
    def refusals():
        return {l.split()[0]: float(l.split()[1]) for l in httpx.get(s.base + "/metrics").text.splitlines()
                if l.startswith("comb_http_refused_total")}
    for attempt in range(3):
        before = refusals()  # the counts this attempt adds are checked
        t_open = time.time()
        for _ in range(200):
            c = socket.create_connection(("127.0.0.1", s.port), timeout=5)
            c.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            conns.append(c)
        opened_in = time.time() - t_open
        # Opening them must take well under the 10 s request deadline, or the first ones time out
        # (and free their places) before the last are counted: on a machine too busy for that,
        # the check says nothing, so it starts again once the server has let them go.
        if opened_in < 7 or attempt == 2:
            break
        print(f"note: opening 200 connections took {opened_in:.1f} s (a busy machine): again")
        for c in conns:
            c.close()
        conns = []
        time.sleep(11)
    time.sleep(0.5)
    t0 = time.time()
    with socket.create_connection(("127.0.0.1", s.port), timeout=5, source_address=("127.0.0.2", 0)) as h:
        h.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = h.recv(4096)
    took = time.time() - t0
    check(answer.startswith(b"HTTP/1.1 200") and took < 1,
          f"/health from another address answers in {took:.2f} s while 200 connections dribble headers")
    open_ = []
    for c in conns:  # the refusals came at once: whatever has not answered by now is held
        c.setblocking(False)
        try:
            data = c.recv(4096)
            if data.startswith(b"HTTP/1.1 429"):
                refused += 1
            c.close()
        except BlockingIOError:
            c.setblocking(True)
            open_.append(c)
    # (the test's own keep-alive connections from this address count too)
    check(refused + len(open_) == 200 and refused >= 72 and len(open_) <= 128,
          f"over the 128 connections one address may hold: {refused} refused at once with 429, {len(open_)} held")
    # The held ones keep sending a header line a second: cut off by the 10 s request deadline.
    t0, answered = time.time(), 0
    while open_ and time.time() - t0 < 14:
        for c in list(open_):
            try:
                c.sendall(b"X-Slow: 1\r\n")
                c.setblocking(False)
                data = c.recv(4096)
                answered += data.startswith(b"HTTP/1.1 408")
                open_.remove(c)
                c.close()
            except BlockingIOError:
                c.setblocking(True)
            except OSError:
                open_.remove(c)
                c.close()
        time.sleep(1)
    took = time.time() - t0
    held = 200 - refused
    check(not open_ and took < 13 and answered == held,
          f"every slow connection ends at the request deadline with 408 ({took:.1f} s, {answered} of {held}, "
          f"{len(open_)} left)")
    for c in open_:
        c.close()
    text, _, _ = chat(s, "What is the capital of France?")
    check(bool(text), "a valid request afterwards succeeds")
    after = refusals()
    m = {k: v - before.get(k, 0) for k, v in after.items()}
    check(m.get('comb_http_refused_total{reason="max_per_client"}') == refused and
          m.get('comb_http_refused_total{reason="request_timeout"}', 0) >= 1,
          f"the refusals are counted in /metrics (added by this attempt: {m})")


def test_cancel_and_metrics(s):
    total = s.metric("comb_kv_blocks_total")
    cancelled = s.metric("comb_requests_cancelled_total")
    body = {"model": s.model, "messages": [{"role": "user", "content": "Write a very long story about the sea."}],
            "max_tokens": 2000, "temperature": 0, "stream": True, "documents": DOCS}
    with httpx.Client(timeout=60) as h, h.stream("POST", s.base + "/v1/chat/completions", json=body) as r:
        n, in_use = 0, 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                n += 1
            if n >= 4:  # read while the stream is open: leaving the loop may close it
                in_use = total - s.metric("comb_kv_blocks_free")
                break
    check(in_use > 0, f"a running request holds blocks ({in_use:.0f})")
    for _ in range(100):  # the client is gone: the next write fails and the request is cancelled
        if s.metric("comb_requests_cancelled_total") > cancelled and s.metric("comb_kv_blocks_free") == total:
            break
        time.sleep(0.1)
    check(s.metric("comb_requests_cancelled_total") == cancelled + 1, "the disconnected request was cancelled")
    check(s.metric("comb_kv_blocks_free") == total, "and its blocks went back to the pool")
    # A non-streamed request whose client goes away is cancelled too (white space probes the socket).
    # Without documents: the bare decoder writes the long story asked for, where the plug-in may
    # answer from the documents in a sentence and finish before the client leaves.
    sock = socket.create_connection(("127.0.0.1", s.port))
    payload = json.dumps({k: v for k, v in {**body, "stream": False}.items() if k != "documents"}).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    time.sleep(1.0)
    sock.close()
    for _ in range(100):
        if s.metric("comb_requests_cancelled_total") == cancelled + 2 and s.metric("comb_kv_blocks_free") == total:
            break
        time.sleep(0.1)
    check(s.metric("comb_requests_cancelled_total") == cancelled + 2 and s.metric("comb_kv_blocks_free") == total,
          "a non-streamed request is cancelled when its client goes away")
    m = httpx.get(s.base + "/metrics").text
    for name in ["comb_http_requests_total", "comb_requests_running", "comb_requests_queued",
                 "comb_time_to_first_token_seconds_bucket", "comb_inter_token_latency_seconds_bucket",
                 "comb_generation_tokens_per_second", "comb_cache_hits_total", "comb_cache_misses_total",
                 "comb_cache_bytes"]:
        check(name in m, f"/metrics has {name}")
    check(s.metric("comb_time_to_first_token_seconds_count") > 0, "TTFT observed")
    check(httpx.get(s.base + "/health").json() == {"status": "ok"}, "GET /health")


def test_overload():
    s = Server("--max-running", "1", "--max-queued", "1", "--method", "full")
    try:
        codes, retry = [], []

        def run():
            r = httpx.post(s.base + "/v1/chat/completions", timeout=300, json={
                "model": s.model, "messages": [{"role": "user", "content": "Tell me about the sea."}],
                "max_tokens": 40, "temperature": 0})
            codes.append(r.status_code)
            if r.status_code == 429:
                retry.append(r.headers.get("Retry-After"))
                check(r.json()["error"]["type"] == "rate_limit_exceeded", "429 carries an OpenAI-shaped error")

        threads = [threading.Thread(target=run) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        check(codes.count(429) >= 1 and codes.count(200) >= 2 and set(codes) <= {200, 429},
              f"overload: some 429, the rest answered ({sorted(codes)})")
        check(all(r is not None for r in retry), "429 carries Retry-After")
        try:
            s.client.chat.completions.create(model=s.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            check(True, "the server answers after overload")
        except openai.APIError as e:
            check(False, f"the server answers after overload ({e})")
        # SIGTERM with a request in flight: it is finished, new ones are refused, the process exits 0.
        result = {}

        def inflight():
            result["r"] = httpx.post(s.base + "/v1/chat/completions", timeout=300, json={
                "model": s.model, "messages": [{"role": "user", "content": "Tell me about the sea."}],
                "max_tokens": 60, "temperature": 0})

        t = threading.Thread(target=inflight)
        t.start()
        time.sleep(0.5)
        s.proc.send_signal(signal.SIGTERM)
        t.join()
        code = s.proc.wait(60)
        r = result["r"]
        check(r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length"),
              "SIGTERM: the request in flight is finished")
        check(code == 0 and "stopped" in s.logs(), f"SIGTERM: the server exits cleanly ({code})")
        log = s.logs()
        check("POST /v1/chat/completions" in log and "ttft=" in log, "one log line per request")
    finally:
        s.stop()


def test_restart():
    """The document store's disk tier (--cache-dir) outlives the server."""
    cache = scratch("comb-serve-cache-")
    docs = [{"title": "Quarry", "text": "The quarry at Helm was closed in 1931 after the river flooded it."}]
    upload = {"title": "Mill", "text": "The mill on the Aber river ground oats until 1958.", "cache_salt": "t1"}
    s = Server("--cache-dir", cache)
    try:
        _, _, first = chat(s, "When was the quarry closed?", docs)
        kept = httpx.post(s.base + "/v1/documents", json=upload, timeout=120).json()["id"]
        gone = httpx.post(s.base + "/v1/documents", json={**upload, "text": "A note that is deleted."}, timeout=120).json()["id"]
        httpx.delete(s.base + f"/v1/documents/{gone}", params={"cache_salt": "t1"})
    finally:
        check(s.stop() == 0, "first server stopped")
    s = Server("--cache-dir", cache)
    try:
        _, _, second = chat(s, "When was the quarry closed?", docs)
        listed = [d["id"] for d in httpx.get(s.base + "/v1/documents", params={"cache_salt": "t1"}).json()["data"]]
        _, _, by_id = chat(s, "When did the mill stop?", [{"id": kept}], salt="t1")
    finally:
        s.stop()
    check(second.prompt_tokens_details.cached_tokens > first.prompt_tokens_details.cached_tokens,
          f"after a restart the documents come from the disk tier ({first.prompt_tokens_details.cached_tokens}, then "
          f"{second.prompt_tokens_details.cached_tokens} cached)")
    check(listed == [kept], f"uploaded ids outlive the restart, deleted ones stay deleted ({listed}, kept {kept})")
    check(by_id.prompt_tokens_details.cached_tokens > 0,
          f"and a request by id reads its cache from disk ({by_id.prompt_tokens_details.cached_tokens} cached)")


def test_disk_budget():
    """--cache-mb bounds the disk tier: least recently used entries go, counted in /metrics."""
    cache = scratch("comb-serve-budget-")
    s = Server("--cache-dir", cache, "--cache-mb", "2", "--method", "naive")
    try:
        for i in range(6):
            text = f"Entry {i}: the lighthouse keeper logged {i * 7 + 3} ships passing in the storm of that year."
            r = httpx.post(s.base + "/v1/documents", json={"text": text, "method": "naive"}, timeout=120)
            check(r.status_code == 200, f"upload {i} ({r.status_code})")
        # The disk tier is written by a thread of its own: measured once nothing waits for it.
        deadline = time.monotonic() + 60
        while s.metric("comb_cache_disk_queued") > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        check(s.metric("comb_cache_disk_queued") == 0, "every queued disk write made within 60 s")
        on_disk = sum(os.path.getsize(os.path.join(cache, f)) for f in os.listdir(cache) if f.endswith(".kv"))
        evicted = [l for l in httpx.get(s.base + "/metrics").text.splitlines()
                   if l.startswith('comb_cache_evictions_total{tier="disk"}')]
    finally:
        s.stop()
    check(0 < on_disk <= 2 << 20, f"the disk tier holds {on_disk} bytes with --cache-mb 2")
    check(evicted and float(evicted[0].split()[1]) > 0, f"and its evictions are counted ({evicted})")


def main():
    s = Server("--served-model-name", ",".join(NAMES))
    try:
        for test in (test_api, test_api_extras, test_loadgen, test_documents, test_concurrency, test_hostile, test_raw_requests, test_request_heads,
                     test_slow_clients, test_cancel_and_metrics):
            t0 = time.time()
            test(s)
            print(f"-- {test.__name__}: {time.time() - t0:.1f} s", flush=True)
    finally:
        code = s.stop()
        check(code == 0, f"the server exits with 0 ({code})")
        if failures:
            print(s.logs()[-5000:])
    for test in (test_overload, test_restart, test_disk_budget):
        t0 = time.time()
        test()
        print(f"-- {test.__name__}: {time.time() - t0:.1f} s", flush=True)
    print(f"{len(failures)} failed" if failures else "all passed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
