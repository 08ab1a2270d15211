"""Reference logits and greedy continuations from Hugging Face transformers loading the same GGUF.

Writes OUT/decoder_reference.safetensors with, for each prompt i:
  p{i}.ids        [n]        prompt token ids
  p{i}.positions  [m]        positions whose logits are stored
  p{i}.logits     [m, vocab] float32 logits at those positions
  p{i}.greedy     [64]       greedy continuation (no stop tokens)
"""
import argparse
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from common import ROOT, mark_done, up_to_date, default_model, qa_items
from tokenizer_reference import smollm2_tokenizer


def prompts(tok):
    nq = qa_items()
    essay = (ROOT / "LICENSE").read_text(encoding="utf-8")
    chat = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    doc = nq[0]["documents"][0]
    texts = [
        "The quick brown fox jumps over the lazy dog by the river",  # short
        chat,
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n",
        f"Title: {doc['title']}\n{doc['text']}\nQuestion: {nq[0]['question']}\nAnswer:",
        essay,
    ]
    out = []
    limits = [10, 40, 60, 250, 500]
    for text, limit in zip(texts, limits):
        ids = tok.encode(text).ids[:limit]
        out.append(ids)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--greedy", type=int, default=64)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    model_path = default_model()
    out_dir = Path(args.out).parent
    if up_to_date(out_dir, "decoder", model_path):
        print("decoder references are up to date")
        return
    model = AutoModelForCausalLM.from_pretrained(model_path.parent, gguf_file=model_path.name, dtype=torch.float32)
    model.eval()
    tok = smollm2_tokenizer(model_path)
    tensors = {}
    with torch.inference_mode():
        for i, ids in enumerate(prompts(tok)):
            n = len(ids)
            x = torch.tensor([ids])
            out = model(x, use_cache=True)
            logits = out.logits[0].float()
            positions = list(range(n)) if n <= 64 else sorted(set(range(0, n, 4)) | {n - 1})
            tensors[f"p{i}.ids"] = x[0].clone()
            tensors[f"p{i}.positions"] = torch.tensor(positions)
            tensors[f"p{i}.logits"] = logits[positions].contiguous()
            past = out.past_key_values
            token = int(logits[-1].argmax())
            greedy = [token]
            for _ in range(args.greedy - 1):
                out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
                past = out.past_key_values
                token = int(out.logits[0, -1].argmax())
                greedy.append(token)
            tensors[f"p{i}.greedy"] = torch.tensor(greedy)
            print(f"prompt {i}: {n} tokens", file=sys.stderr)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, args.out)
    mark_done(out_dir, "decoder", model_path)


if __name__ == "__main__":
    main()
