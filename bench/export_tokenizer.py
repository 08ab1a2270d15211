"""Writes the default model's tokenizer (tokenizer.json, tokenizer_config.json) from its GGUF file
into a folder, for the random-weight models of bench/gpu.sh.

    .venv/bin/python bench/export_tokenizer.py OUT_DIR [--model FILE.gguf]
"""
import argparse
import sys
from pathlib import Path

from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "oracle"))
from common import default_model  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    path = Path(args.model) if args.model else default_model()
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(args.out)
    print(f"{args.out}: the tokenizer of {path.name}")


if __name__ == "__main__":
    main()
