"""transformers' float32 and bfloat16 logits of one model folder, teacher-forced as comb's check of
its own bfloat16 path feeds it (tests/helpers.hpp, check_bf16_like_transformers).

    python tests/oracle/bf16_reference.py --model DIR --out FILE [--device cuda]

Random token ids (a fixed seed) are fed as a prompt of --prompt tokens in one forward, --more
tokens after it in one forward, then --steps tokens one a step through the KV cache; every
position's logits are kept. Writes FILE (safetensors):
  ids              [n] int64, n = prompt + more + steps
  split            [3] int64: prompt, more, steps
  logits_float32   [n, vocab] float32: the model in float32 (the reference)
  logits_bfloat16  [n, vocab] float32: the model in bfloat16 (SDPA), its logits widened
"""
import argparse
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import mark_done, up_to_date  # noqa: E402


def teacher_forced(model, ids, split, device):
    prompt, more, steps = split
    x = ids.to(device)[None]
    out = model(x[:, :prompt], use_cache=True)
    logits, past = [out.logits[0].float()], out.past_key_values
    out = model(x[:, prompt:prompt + more], past_key_values=past, use_cache=True)
    logits.append(out.logits[0].float())
    past = out.past_key_values
    for i in range(prompt + more, prompt + more + steps):
        out = model(x[:, i:i + 1], past_key_values=past, use_cache=True)
        logits.append(out.logits[0].float())
        past = out.past_key_values
    return torch.cat(logits).cpu().contiguous()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="a Hugging Face model folder (config.json, safetensors)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompt", type=int, default=100)
    ap.add_argument("--more", type=int, default=20)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--stamp", action="store_true", help="skip when OUT's folder holds a stamp of the same model")
    args = ap.parse_args()
    if min(args.prompt, args.more, args.steps) < 1:
        sys.exit(f"--prompt, --more and --steps: expected counts >= 1, found {args.prompt}, {args.more}, {args.steps}")
    model_dir, out = Path(args.model), Path(args.out)
    config = model_dir / "config.json"
    if args.stamp and up_to_date(out.parent, "bf16", config):
        print("bf16 references are up to date")
        return
    torch.manual_seed(0)
    if args.device == "cpu":
        torch.set_num_threads(2)
    split = (args.prompt, args.more, args.steps)
    tensors = {"split": torch.tensor(split, dtype=torch.int64)}
    with torch.inference_mode():
        for dtype, name in ((torch.float32, "logits_float32"), (torch.bfloat16, "logits_bfloat16")):
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
            model = model.to(args.device).eval()
            if "ids" not in tensors:
                vocab = model.config.vocab_size
                gen = torch.Generator().manual_seed(11)
                tensors["ids"] = torch.randint(min(1000, vocab // 2), vocab, (sum(split),), generator=gen)
            tensors[name] = teacher_forced(model, tensors["ids"], split, args.device)
            del model
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out))
    if args.stamp:
        mark_done(out.parent, "bf16", config)
    print(f"{out}: {sum(split)} positions, vocab {tensors['logits_float32'].shape[1]}", file=sys.stderr)


if __name__ == "__main__":
    main()
