"""A small random Llama in the Hugging Face layout (sharded safetensors, untied head, llama3 RoPE
scaling) and transformers' logits for it: checks comb's safetensors, config.json and tokenizer.json
paths, and RoPE scaling, against the reference implementation.

Writes OUT/tiny-llama/ (config.json, model-0000x-of-0000y.safetensors, the index, tokenizer.json)
and OUT/tiny_reference.safetensors {ids [n], logits [n, vocab]}.
"""
import argparse
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from common import mark_done, up_to_date


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer", required=True, help="a tokenizer.json to ship with the model")
    args = ap.parse_args()
    torch.manual_seed(7)
    out = Path(args.out)
    if up_to_date(out, "tiny", Path(args.tokenizer)):
        print("tiny model is up to date")
        return
    config = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger weights than the default init, so that errors show
        for p in model.parameters():
            p.normal_(0, 0.08)
    target = out / "tiny-llama"
    if target.exists():
        shutil.rmtree(target)
    model.save_pretrained(target, max_shard_size="2MB")
    shutil.copy(args.tokenizer, target / "tokenizer.json")
    ids = torch.randint(1000, 49152, (300,), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        logits = model(ids[None]).logits[0].float()
    save_file({"ids": ids, "logits": logits.contiguous()}, str(out / "tiny_reference.safetensors"))
    mark_done(out, "tiny", Path(args.tokenizer))


if __name__ == "__main__":
    main()
