"""The baseline of `comb bench`: Hugging Face transformers on the same model (a GGUF file or a Hugging
Face folder), dtype, device and threads.

Prints one JSON object per figure, in the format of `comb bench --json`.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "oracle"))
from common import default_model  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompt-tokens", default="128,512,2048")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = Path(args.model) if args.model else default_model()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    if path.is_dir():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    model = model.to(args.device).eval()
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1234)

    def prompt(n):
        return torch.randint(1000, vocab, (1, n), generator=gen).to(args.device)

    def done():  # the device's work finished (timings end here)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    with torch.inference_mode():
        for n in [int(x) for x in args.prompt_tokens.split(",")]:
            ids = prompt(n)
            times = []
            for r in range(args.repeat + 1):  # the first run warms up
                t0 = time.perf_counter()
                model(ids, use_cache=True, logits_to_keep=1)  # what generate() does at prefill
                done()
                if r:
                    times.append(time.perf_counter() - t0)
            print(json.dumps({"bench": "prefill", "tokens": n, "tokens_per_s": n / statistics.median(times)}), flush=True)
        if args.decode_tokens > 0:
            rates = []
            for r in range(args.repeat + 1):
                out = model(prompt(128), use_cache=True, logits_to_keep=1)
                past, token = out.past_key_values, out.logits[0, -1].argmax()
                t0 = time.perf_counter()
                for _ in range(args.decode_tokens):
                    out = model(token.view(1, 1), past_key_values=past, use_cache=True)
                    past, token = out.past_key_values, out.logits[0, -1].argmax()
                done()
                if r:
                    rates.append(args.decode_tokens / (time.perf_counter() - t0))
            print(json.dumps({"bench": "decode", "tokens": args.decode_tokens, "tokens_per_s": statistics.median(rates)}),
                  flush=True)


if __name__ == "__main__":
    main()
