"""vLLM's own scheduler tests as the field corpus, per release (issue 22): ``harness vllm-tests``
on whole test files, with the figures the docs quote.

    HARNESS_VLLM_ENVS=... .venv/bin/python bench/vllm_own_tests.py [VERSION ...] \\
        [--files tests/v1/core/test_scheduler.py ...] [-o DIR]

Default: 0.33.0 on ``tests/v1/core/test_scheduler.py`` and ``test_prefix_caching.py`` (the envs must
exist: ``harness vllm-env VERSION``). For each release it prints the per-file table of
``harness vllm-tests``, the totals against the goals of issue 22 (no test broken by the recorder, at
least 90 % of recordings converted, no unexplained violation, replay identical on every clean trace)
and the CPU seconds of the plain and the injected pytest runs (their ratio: what the recorder costs
on vLLM's own tests). Not run by the test suite (tests/test_vllm_own_tests.py runs a selection).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("versions", nargs="*", default=["0.33.0"])
    parser.add_argument("--files", nargs="*", default=[])
    parser.add_argument("-o", "--out", default="/tmp/vllm-own-tests")
    args = parser.parse_args()
    print(f"# bench/vllm_own_tests.py {' '.join(sys.argv[1:])} on {platform.node()} "
          f"({platform.processor() or platform.machine()})")
    worst = 0
    for version in args.versions:
        out = Path(args.out) / version
        cmd = [str(REPO / ".venv/bin/harness"), "vllm-tests", version, "-o", str(out), "--json"]
        for f in args.files:
            cmd += ["--files", f]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode not in (0, 1):
            print(f"vLLM {version}: harness vllm-tests exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
            worst = max(worst, 2)
            continue
        report = json.loads(proc.stdout)
        from harness.vllm_tests_report import render

        for line in render(report):
            print(line)
        rec = report["recordings"] or 1
        print(f"goals {version}: broken_by_recorder {len(report['broken_by_recorder'])} (goal 0); "
              f"converted {report['converted']}/{report['recordings']} = {100 * report['converted'] / rec:.0f} % "
              f"(goal >= 90 %); unexplained violations {len(report['violations'])} (goal 0); replay "
              f"{report['replay_identical']} identical, {report['replay_diverged']} diverged of "
              f"{report['clean']} clean (goal: all identical)")
        ratio = report["injected_cpu_s"] / report["plain_cpu_s"] if report["plain_cpu_s"] else float("nan")
        print(f"cpu {version}: plain pytest {report['plain_cpu_s']} s, injected {report['injected_cpu_s']} s "
              f"(x{ratio:.2f})")
        worst = max(worst, proc.returncode)
    return worst


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
