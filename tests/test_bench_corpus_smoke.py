"""bench/bench_corpus.py runs in its smoke mode (issue 25): 12 traces on one
worker, a pool of 2 and a local Ray cluster (skipped without Ray); every
runner gives the rows of one worker (the script exits 1 otherwise). Figures
printed, nothing asserted about speed."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_corpus_smoke(tmp_path: Path) -> None:
    ray = importlib.util.find_spec("ray") is not None
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_corpus.py"), "--smoke",
                           *([] if ray else ["--no-ray"])], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "corpus: 12 traces, 2777 steps; 12 traces: 12 conformant (exit 0)" in lines
    runners = [line.split("  ")[0] for line in lines if line.endswith("  yes")]
    assert runners == ["1 worker", "2 workers", *(["Ray, local 2 CPUs"] if ray else [])]
