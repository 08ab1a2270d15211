"""Writes a Llama-shaped model with random bfloat16 weights in the Hugging Face layout, for speed
measurements (the time of a forward does not depend on the weights' values).

    python bench/make_random_llama.py --shape 1b --tokenizer TOKENIZER_DIR --out OUT_DIR

Shapes: "1b" (Llama-3.2-1B: 16 layers of 2048, 32/8 heads of 64, tied head) and "8b" (Llama-3.1-8B:
32 layers of 4096, 32/8 heads of 128), with TOKENIZER_DIR's vocabulary (tokenizer.json and
tokenizer_config.json copied beside the weights). Made on a CUDA device when there is one.
"""
import argparse
import json
import shutil
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    # The default model's shape (SmolLM2-135M): 30 layers of 576, 9/3 heads of 64, tied head.
    "135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, head_dim=64, tie_word_embeddings=True),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--tokenizer", required=True, help="folder with tokenizer.json and tokenizer_config.json")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = Path(args.out)
    if (out / "config.json").exists():
        print(f"{out}: already made")
        return
    tok = Path(args.tokenizer)
    vocab = len(json.loads((tok / "tokenizer.json").read_text())["model"]["vocab"])
    config = LlamaConfig(vocab_size=vocab, max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                         bos_token_id=1, eos_token_id=2, **SHAPES[args.shape])
    torch.manual_seed(args.seed)
    t0 = time.time()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model.eval()
    # Written beside OUT and renamed when whole: a run killed while saving leaves no OUT that a later
    # run would take as made (save_pretrained writes config.json before the weights).
    part = out.parent / (out.name + ".part")
    shutil.rmtree(part, ignore_errors=True)
    part.mkdir(parents=True)
    model.save_pretrained(part)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (tok / name).exists():
            shutil.copy(tok / name, part / name)
    shutil.rmtree(out, ignore_errors=True)
    part.rename(out)
    n = sum(p.numel() for p in model.parameters())
    print(f"{out}: {args.shape}, {n / 1e9:.2f}B parameters, made in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
