"""``harness model tiny``: a small random-weight model for a real vLLM engine, from a seed.

vLLM needs a model directory; the hub is not reachable here and the scheduler
checks do not care what the weights are. ``build_tiny_model`` runs
``harness/serve/tiny_model_script.py`` under the serving env's Python (its pinned
torch and transformers make the bytes reproducible), writes into a temporary
sibling folder and renames it into place, so a failure leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from harness.candidates.vllm.env import VLLMEnvError
from harness.serve.env import require_serving_env

SCRIPT = Path(__file__).with_name("tiny_model_script.py")
ARCHS = ("llama", "qwen2", "opt")
#: Default vocabulary: the synthesised prompt tokens of workloads/ are below 32000.
DEFAULT_VOCAB = 32000


class ModelError(RuntimeError):
    """The model could not be written; the message is one line."""


def model_digest(path: str | Path) -> str:
    """sha256 over the folder's files (name and bytes, sorted by name): same seed, same digest."""
    h = hashlib.sha256()
    for f in sorted(Path(path).iterdir()):
        if f.is_file():
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def read_vocab_size(path: str | Path) -> int | None:
    """The model's ``vocab_size`` from its config.json, or None if absent."""
    import json

    try:
        return int(json.loads((Path(path) / "config.json").read_text())["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


#: What a tiny-model folder holds (tiny_model_script.py): all that --force may replace.
MODEL_FILES = frozenset({"config.json", "generation_config.json", "model.safetensors"})


def check_tiny_model_args(out: str | Path, *, arch: str = "llama", vocab: int = DEFAULT_VOCAB,
                          force: bool = False) -> Path:
    """``out`` as a Path if a tiny model may be written there (``build_tiny_model``'s
    checks, made before any work: ``harness model tiny`` builds the serving env
    only after them). Raises ModelError."""
    if arch not in ARCHS:
        raise ModelError(f"unknown arch {arch!r}: expected one of {', '.join(ARCHS)}")
    if not 16 <= vocab <= 1_000_000:
        raise ModelError(f"--vocab {vocab}: expected 16..1000000")
    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())) and not force:
        raise ModelError(f"{target}: exists and is not empty (pass --force to replace it)")
    if force and (target.exists() or target.is_symlink()):
        # --force replaces a folder this command wrote, never anything else
        # (`-o . --force` removed the current folder, `-o / --force` would try /).
        if target.is_symlink() or not target.is_dir():
            raise ModelError(f"{target}: --force replaces a tiny-model folder; this is not a folder")
        foreign = sorted(p.name for p in target.iterdir() if p.name not in MODEL_FILES or not p.is_file()
                         or p.is_symlink())
        if foreign:
            raise ModelError(f"{target}: --force replaces only a tiny-model folder, and it holds "
                             f"{foreign[0]!r}{f' and {len(foreign) - 1} more' if len(foreign) > 1 else ''} "
                             f"(choose a new or empty folder)")
    return target


def build_tiny_model(out: str | Path, *, seed: int = 0, arch: str = "llama",
                     vocab: int = DEFAULT_VOCAB, force: bool = False) -> dict:
    """Write a tiny ``arch`` model with random weights drawn from ``seed`` to folder ``out``.

    Returns ``{"path", "parameters", "bytes", "sha256"}`` (``sha256``: ``model_digest``).
    Raises ModelError for a bad argument, an existing non-empty ``out`` (unless
    ``force``) or a failed build, VLLMEnvError when the serving env is missing.
    """
    target = check_tiny_model_args(out, arch=arch, vocab=vocab, force=force)
    python = require_serving_env()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
               PYTHONHASHSEED="0")
    env.pop("PYTHONPATH", None)
    try:
        proc = subprocess.run([str(python), str(SCRIPT), str(tmp), str(seed), arch, str(vocab)],
                              capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
            raise ModelError(f"building the tiny {arch} model failed (exit {proc.returncode}): "
                             f"{lines[-1][:200] if lines else 'no output'}")
        params = int(proc.stdout.strip().splitlines()[-1])
        tmp.chmod(0o755)
        if target.exists():
            shutil.rmtree(target) if target.is_dir() else target.unlink()
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    size = sum(f.stat().st_size for f in target.iterdir() if f.is_file())
    return {"path": str(target), "parameters": params, "bytes": size, "sha256": model_digest(target)}


__all__ = ["ARCHS", "DEFAULT_VOCAB", "ModelError", "VLLMEnvError", "build_tiny_model", "check_tiny_model_args",
           "model_digest",
           "read_vocab_size"]
