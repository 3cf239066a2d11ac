"""Every script in bench/ runs in its smoke mode (issue 24): a benchmark that
crashes fails the suite. Small inputs, figures printed, nothing asserted
about speed; each writes its section to a temporary page (``--page``),
never the committed docs/benchmarks.md. The ones that drive real vLLM are
marked ``vllm``. Also: the page keeps every other section byte for byte
when one bench rewrites its own (bench/page.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))
import page  # noqa: E402

# The scripts that need only this project's venv, and those that drive vLLM.
# (progress_soundness's smoke run is the reference alone; fork_experiment's and vllm_own_tests's
# drive vLLM 0.33.0, the latter on two of its own tests from the release's sdist.)
PLAIN = ["bench_check", "bench_corpus", "bench_isolation", "bench_memory", "bench_reference", "bench_torch",
         "bench_views", "progress_soundness"]
VLLM = ["bench_vllm", "bench_fuzz_vllm", "bench_serve", "bench_serve_breakdown", "fork_experiment", "semantics_versions",
        "vllm_async_spec_sweep", "vllm_fidelity", "vllm_own_tests"]


def test_every_bench_script_has_a_smoke_run() -> None:
    scripts = {p.stem for p in BENCH.glob("*.py")} - {"page"}
    assert scripts == set(PLAIN) | set(VLLM)


def _smoke(name: str, tmp_path: Path) -> None:
    target = tmp_path / "benchmarks.md"
    committed = ROOT / "docs" / "benchmarks.md"
    before = committed.read_bytes() if committed.is_file() else None
    proc = subprocess.run([sys.executable, str(BENCH / f"{name}.py"), "--smoke", "--page", str(target)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=900)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = target.read_text()
    assert f"<!-- bench:{name} -->\n## {name}\n\n`python bench/{name}.py --smoke`" in text, text[:2000]
    assert (committed.read_bytes() if committed.is_file() else None) == before


@pytest.mark.parametrize("name", PLAIN)
def test_bench_smoke(name: str, tmp_path: Path) -> None:
    _smoke(name, tmp_path)


@pytest.mark.vllm
@pytest.mark.parametrize("name", VLLM)
def test_bench_smoke_vllm(name: str, tmp_path: Path) -> None:
    _smoke(name, tmp_path)


def test_gpu_check_script_parses() -> None:
    # bench/gpu_check.sh needs a CUDA machine; here it is only parsed.
    assert subprocess.run(["bash", "-n", str(BENCH / "gpu_check.sh")]).returncode == 0


def test_a_section_rewrite_keeps_every_other_byte(tmp_path: Path) -> None:
    target = tmp_path / "benchmarks.md"
    page.write_section(target, "b", "## b\n\nfirst\n")
    page.write_section(target, "a", "## a\n\none\n")
    page.write_section(target, "c", "## c\n\nthree\n")
    page.write_section(target, "b", "## b\n\nsecond\n")
    assert target.read_text() == (
        page.PREAMBLE + "\n"
        "<!-- bench:a -->\n## a\n\none\n<!-- /bench:a -->\n\n"
        "<!-- bench:b -->\n## b\n\nsecond\n<!-- /bench:b -->\n\n"
        "<!-- bench:c -->\n## c\n\nthree\n<!-- /bench:c -->\n")


def test_smoke_without_page_writes_a_temporary_page(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(page, "PAGE", tmp_path / "committed.md")
    monkeypatch.setattr(sys, "argv", ["bench/fake.py", "--smoke"])
    assert page.run(lambda: print("figures 1.0x") or 0, "fake") == 0
    assert not (tmp_path / "committed.md").exists()
    assert "section fake written to " in capsys.readouterr().err


def test_progress_soundness_marks_a_releases_known_finding_and_nothing_else() -> None:
    # 0.29.0's fenced-victim preemptions (vllm#49674) are a known finding only at their exact
    # count; one more, or the same count on another release, is not.
    import progress_soundness as ps

    known = {"status": "recorded", "by_invariant": {"PROGRESS-PREEMPT-FREES": 7}}
    one_more = {"status": "recorded", "by_invariant": {"PROGRESS-PREEMPT-FREES": 8, "BLOCK-CONSERVATION": 1}}
    assert ps.progress_fired("vllm 0.29.0", "deferred-frees", known) == ({"PROGRESS-PREEMPT-FREES": 7}, True)
    assert ps.progress_fired("vllm 0.29.0", "deferred-frees", one_more) == ({"PROGRESS-PREEMPT-FREES": 8}, False)
    assert ps.progress_fired("vllm 0.31.0", "deferred-frees", known) == ({"PROGRESS-PREEMPT-FREES": 7}, False)
    rows = ps.table({"vllm 0.29.0": {"deferred-frees": known, "fcfs-tight": {"status": "refused"}},
                     "vllm 0.31.0": {"deferred-frees": one_more, "fcfs-tight": {"status": "error"}}})
    assert rows[2:] == [
        "| vllm 0.29.0 | 1 | 1 | 0 | silent | silent | silent | **7** (known) | silent | 0 |",
        "| vllm 0.31.0 | 1 | 0 | 1 | silent | silent | silent | **8** | silent | 1 |"]
