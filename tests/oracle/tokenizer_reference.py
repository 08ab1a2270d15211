"""Reference tokenizations from Hugging Face `tokenizers`.

The SmolLM2 tokenizer is rebuilt in `tokenizers` from the GGUF vocabulary and merges with the
pre-tokenizer SmolLM2 was trained with (digits split one by one, then GPT-2's byte-level regex;
the GGUF names it "smollm"). A second tokenizer.json uses the same vocabulary with Llama-3's split
regex, to check comb's tokenizer.json loader and that pre-tokenizer.

Writes OUT/smollm2.jsonl and OUT/llama3/{tokenizer.json, cases.jsonl}: one {"text", "ids"} per line.
"""
import argparse
import json
import random
from pathlib import Path

from gguf import GGUFReader
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from common import mark_done, up_to_date, default_model, kv_records, prose, qa_items

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def gguf_vocab(path: Path):
    r = GGUFReader(str(path))
    f = r.fields
    tokens = [str(bytes(f["tokenizer.ggml.tokens"].parts[i]), "utf-8") for i in f["tokenizer.ggml.tokens"].data]
    merges = [str(bytes(f["tokenizer.ggml.merges"].parts[i]), "utf-8") for i in f["tokenizer.ggml.merges"].data]
    types = [int(f["tokenizer.ggml.token_type"].parts[i][0]) for i in f["tokenizer.ggml.token_type"].data]
    return tokens, merges, types


def build(path: Path, pre) -> Tokenizer:
    tokens, merges, types = gguf_vocab(path)
    vocab = {t: i for i, t in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges])
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3]
    tok.add_special_tokens(special)
    return tok


def smollm2_tokenizer(path: Path) -> Tokenizer:
    return build(path, pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]))


def llama3_split_tokenizer(path: Path) -> Tokenizer:
    return build(path, pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]))


UNICODE_POOL = (
    "héllo wörld façade naïve Ærø Ĳssel ß ẞ "
    "日本語のテキスト 中文字符 한국어 텍스트 "
    "Привет мир Ελληνικά עברית العربية हिन्दी ภาษาไทย "
    "😀 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ ✓ ∑∫√∞ ≠ ≤ ≥ € £ ¥ ₹ "
    "e\u0301 a\u0308 \u00a0nbsp \u2003em\u2003space \u3000ideo \u200bzero\u200dwidth "
    "ﬁ ligature Ⅻ ½ ² ³ ٣٤٥ １２３ ｆｕｌｌ "
)

CODE = [
    "def f(x):\n\treturn x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) {\n    sum += a[i] * b[i];\n}\n",
    '{"key": "value", "list": [1, 2.5, -3e10], "nested": {"a": null}}',
    "#include <vector>\nint main() { std::vector<int> v{1,2,3}; return v.size(); }",
    "SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name;",
    "x = [i for i in range(10) if i % 2 == 0]\nprint(f'{x!r:>10}')",
    "if [ -f \"$file\" ]; then\n  echo \"exists\" >&2\nfi",
    "<div class=\"main\">\n  <p>Hello &amp; welcome</p>\n</div>",
]


def cases(seed: int = 1234):
    rng = random.Random(seed)
    out = ["", " ", "\n", "a", "  leading", "trailing  ", "I'm", "DON'T", "you'LL", "it's 'quoted'"]
    nq = qa_items()
    docs = [d for item in nq for d in item["documents"]]
    for _ in range(500):
        d = rng.choice(docs)
        text = d["text"]
        a = rng.randrange(len(text))
        out.append(text[a:a + rng.choice([20, 80, 300, 1000])])
    out += [item["question"] for item in nq]
    out += [d["title"] for d in docs[:60]]
    for records in kv_records():
        # Documents as the kv data writes them: JSON objects of 5 pairs; and the question.
        for a in range(0, len(records), 5):
            out.append(json.dumps(dict(records[a:a + 5]))[:400])
        out.append(f'Extract the value corresponding to the key "{records[0][0]}" from the JSON objects above.')
    texts = [p.read_text(encoding="utf-8") for p in prose()]
    for _ in range(300):
        t = rng.choice(texts)
        a = rng.randrange(len(t))
        out.append(t[a:a + rng.choice([50, 200, 1500])])
    for _ in range(300):
        words = UNICODE_POOL.split(" ")
        out.append(" ".join(rng.choice(words) for _ in range(rng.randint(1, 12))))
    for _ in range(150):
        out.append("".join(chr(rng.choice([rng.randint(0x20, 0x7e), rng.randint(0xa0, 0x2fff),
                                           rng.randint(0x3000, 0xd7ff), rng.randint(0x1f300, 0x1faff)]))
                           for _ in range(rng.randint(1, 30))))
    for _ in range(200):
        out.append(rng.choice(CODE) * rng.randint(1, 3))
    for _ in range(200):
        pieces = [rng.choice([" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n ", "\u00a0", "word", "Word", "x"])
                  for _ in range(rng.randint(1, 15))]
        out.append("".join(pieces))
    for _ in range(200):
        out.append(rng.choice([
            str(rng.randint(0, 10 ** rng.randint(1, 15))),
            f"{rng.uniform(-1e6, 1e6):.{rng.randint(0, 6)}f}",
            f"{rng.randint(1, 28)}/{rng.randint(1, 12)}/{rng.randint(1900, 2100)}",
            f"+1 ({rng.randint(100, 999)}) {rng.randint(100, 999)}-{rng.randint(1000, 9999)}",
            f"abc{rng.randint(0, 99999)}def {rng.randint(0, 9)}x{rng.randint(0, 9)}",
            f"{rng.randint(1, 999):,} people, {rng.random():.3e} and ٣٤ or １２",
        ]))
    roles = ["system", "user", "assistant"]
    for _ in range(200):
        msgs = "".join(f"<|im_start|>{rng.choice(roles)}\n{rng.choice(docs)['text'][:rng.randint(5, 200)]}<|im_end|>\n"
                       for _ in range(rng.randint(1, 3)))
        out.append(msgs + rng.choice(["", "<|im_start|>assistant\n", "<|endoftext|>"]))
    # Long pieces, where BPE merges thousands of symbols inside one pre-tokenized piece: words of
    # random letters, runs of one letter, of one CJK character, of one emoji, of spaces.
    for n in (1000, 4000):
        out.append("".join(rng.choice("etaoinshrdlucmfwypvbgkjqxz") for _ in range(n)))
        out.append("a" * n)
    out += ["語" * 1500, "😀" * 800, " " * 3000 + "x", "ab" * 1500 + " end", "Z" * 2500]
    return out


def chat_cases(path: Path):
    """The GGUF's own chat template rendered with Jinja, as transformers renders it."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    r = GGUFReader(str(path))
    field = r.fields["tokenizer.chat_template"]
    source = str(bytes(field.parts[field.data[0]]), "utf-8")
    template = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(source)
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Capital of Peru?"}],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
         {"role": "user", "content": "Tell me a joke\nabout cats."}],
        [{"role": "user", "content": "  spaces around  "}],
    ]
    out = []
    for messages in conversations:
        for gen in (True, False):
            out.append({"messages": messages, "add_generation_prompt": gen,
                        "text": template.render(messages=messages, add_generation_prompt=gen)})
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    (out / "llama3").mkdir(parents=True, exist_ok=True)
    model = default_model()
    if up_to_date(out, "tokenizer", model):
        print("tokenizer references are up to date")
        return
    texts = cases()
    for tok, path in [(smollm2_tokenizer(model), out / "smollm2.jsonl"),
                      (llama3_split_tokenizer(model), out / "llama3" / "cases.jsonl")]:
        with open(path, "w", encoding="utf-8") as f:
            for t in texts:
                f.write(json.dumps({"text": t, "ids": tok.encode(t).ids}, ensure_ascii=False) + "\n")
    llama3_split_tokenizer(model).save(str(out / "llama3" / "tokenizer.json"))
    with open(out / "chat_cases.jsonl", "w", encoding="utf-8") as f:
        for case in chat_cases(model):
            f.write(json.dumps(case, ensure_ascii=False) + "\n")
    mark_done(out, "tokenizer", model)
    print(f"{len(texts)} cases")


if __name__ == "__main__":
    main()
