"""transformers' float32 and bfloat16 logits of one model folder, teacher-forced as comb's check of
its own bfloat16 path feeds it (tests/helpers.hpp, check_bf16_like_transformers).

    python tests/oracle/bf16_reference.py --model DIR --out FILE [--device cuda]

Random token ids (a fixed seed) are fed as a prompt of --prompt tokens in one forward, --more
tokens after it in one forward (every row's logits kept), --pieces forwards of --piece-len tokens
(each one's last row's logits kept: what comb runs as a graph bucket on a GPU), then --steps tokens
one a step through the KV cache. Writes FILE (safetensors):
  ids              [n] int64, n = prompt + more + pieces x piece_len + steps
  split            [5] int64: prompt, more, pieces, piece_len, steps
  logits_float32   [rows, vocab] float32: the model in float32 (the reference); rows = prompt +
                   more + pieces + steps
  logits_bfloat16  [rows, vocab] float32: the model in bfloat16 (SDPA), its logits widened
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
    prompt, more, pieces, piece_len, steps = split
    x = ids.to(device)[None]
    out = model(x[:, :prompt], use_cache=True)
    logits, past = [out.logits[0].float()], out.past_key_values
    at = prompt
    for n, rows in [(more, "all")] + [(piece_len, "last")] * pieces + [(1, "all")] * steps:
        out = model(x[:, at:at + n], past_key_values=past, use_cache=True)
        logits.append(out.logits[0].float() if rows == "all" else out.logits[0, -1:].float())
        past = out.past_key_values
        at += n
    return torch.cat(logits).cpu().contiguous()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="a Hugging Face model folder (config.json, safetensors)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompt", type=int, default=100)
    ap.add_argument("--more", type=int, default=20)
    ap.add_argument("--pieces", type=int, default=3)
    ap.add_argument("--piece-len", type=int, default=7)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--stamp", action="store_true", help="skip when OUT's folder holds a stamp of the same model")
    args = ap.parse_args()
    counts = (args.prompt, args.more, args.pieces, args.piece_len, args.steps)
    if min(counts) < 1:
        sys.exit(f"--prompt, --more, --pieces, --piece-len and --steps: expected counts >= 1, found {counts}")
    model_dir, out = Path(args.model), Path(args.out)
    config = model_dir / "config.json"
    if args.stamp and up_to_date(out.parent, "bf16", config):
        print("bf16 references are up to date")
        return
    torch.manual_seed(0)
    if args.device == "cpu":
        torch.set_num_threads(2)
    split = counts
    n_ids = args.prompt + args.more + args.pieces * args.piece_len + args.steps
    tensors = {"split": torch.tensor(split, dtype=torch.int64)}
    for dtype, name in ((torch.float32, "logits_float32"), (torch.bfloat16, "logits_bfloat16")):
        with torch.no_grad():  # loaded and moved as plain tensors; the forwards in inference mode
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
            model = model.to(args.device).eval()
        if "ids" not in tensors:
            vocab = model.config.vocab_size
            gen = torch.Generator().manual_seed(11)
            tensors["ids"] = torch.randint(min(1000, vocab // 2), vocab, (n_ids,), generator=gen)
        with torch.inference_mode():
            tensors[name] = teacher_forced(model, tensors["ids"], split, args.device)
        del model
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out))
    if args.stamp:
        mark_done(out.parent, "bf16", config)
    print(f"{out}: {n_ids} tokens, {tensors['logits_float32'].shape[0]} rows of logits, vocab "
          f"{tensors['logits_float32'].shape[1]}", file=sys.stderr)


if __name__ == "__main__":
    main()
