"""Sweep: async scheduling with speculative decoding, reference vs real vLLM 0.33.0.

Draws ``--configs`` cases from the fuzzer's strategy restricted to async
scheduling with drafts (``harness.fuzz.strategies.fuzz_cases(async_spec=True)``:
1-3 speculative tokens, two batches in flight, every other dimension as the
fuzzer draws it: tiny pools, PRIORITY, thresholds, EOS, aborts, deferred
frees, the KV connector, DP; not encoder inputs, which the driver does not
pass), runs each in memory on the
reference and on ``vllm@0.33.0`` through the driver, checks every invariant
on both (a violation is named by ``known_reference_finding`` when it is one
of the known vLLM 0.33.0 findings), and compares every row of every step. Prints the configs, the steps
compared and identical, the preemptions and stale speculative outputs seen,
and the first divergence or violation of each failing case.

    HARNESS_VLLM_ENVS=/tmp/base/.vllm-envs python bench/vllm_async_spec_sweep.py --configs 500 --seed 2024

Needs vLLM 0.33.0's environment (``harness vllm-env 0.33.0``).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/page.py
import page  # noqa: E402

from hypothesis import HealthCheck, Phase, given, seed as hyp_seed, settings  # noqa: E402

from harness.candidates.resolve import resolve_candidate  # noqa: E402
from harness.fuzz.run import Failure, known_reference_finding, run_case  # noqa: E402
from harness.fuzz.strategies import fuzz_cases  # noqa: E402
from harness.replay import first_difference  # noqa: E402
from reference.scheduler import Scheduler  # noqa: E402


def stale_spec_outputs(steps) -> int:
    """Outputs of a batch with drafts whose request was preempted after the batch was scheduled."""
    drafts: dict[tuple[int, str], bool] = {}
    preempted_at: dict[str, int] = {}
    batch = None
    count = 0
    for _, rows in steps:
        for r in rows:
            kind = r["kind"]
            if kind == "schedule":
                drafts[(r["step"], r["request_id"])] = bool(r["spec_token_ids"])
            elif kind == "preempt":
                preempted_at[r["request_id"]] = r["step"]
            elif kind == "update_begin":
                batch = r["batch_step"]
            elif kind == "output" and drafts.get((batch, r["request_id"])):
                count += preempted_at.get(r["request_id"], -1) > batch
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", type=int, default=200, help="cases to draw (default 200)")
    parser.add_argument("--seed", type=int, default=2024, help="hypothesis seed (default 2024)")
    parser.add_argument("--version", default="0.33.0", help="vLLM version (default 0.33.0)")
    parser.add_argument("--smoke", action="store_true", help="the test suite's run: --configs 2")
    args = parser.parse_args(argv)
    if args.smoke:
        args.configs = 2
    factory = resolve_candidate(f"vllm@{args.version}")
    totals = {"configs": 0, "identical": 0, "steps": 0, "identical_steps": 0, "preemptions": 0,
              "stale_spec_outputs": 0, "ref_violations": 0, "vllm_violations": 0}
    failures: list[str] = []
    known: dict[str, dict[str, int]] = {"ref_violations": {}, "vllm_violations": {}}
    start = time.monotonic()

    @settings(max_examples=args.configs, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck), phases=[Phase.generate])
    @hyp_seed(args.seed)
    # Encoder inputs are not driven (the driver passes no multimodal features).
    @given(fuzz_cases(async_spec=True).filter(lambda c: "max_num_encoder_input_tokens" not in c.config))
    def sweep(case) -> None:
        totals["configs"] += 1
        ref = run_case(Scheduler, case)
        real = run_case(factory, case)
        gc.collect()
        totals["steps"] += len(ref.steps)
        totals["preemptions"] += sum(r["kind"] == "preempt" for _, rows in ref.steps for r in rows)
        totals["stale_spec_outputs"] += stale_spec_outputs(ref.steps)
        for run, key in ((ref, "ref_violations"), (real, "vllm_violations")):
            if not run.result.ok:
                failure = Failure("reference-violation", "", dict(run.result.by_invariant))
                name = known_reference_finding(case, failure) or "not a known finding"
                known[key][name] = known[key].get(name, 0) + 1
                totals[key] += 1
        same = 0
        diff = None
        for (rs, rrows), (cs, crows) in zip(ref.steps, real.steps):
            diff = first_difference(rs, rrows, crows) if rs == cs else f"step numbers {rs} != {cs}"
            if diff is not None:
                break
            same += 1
        totals["identical_steps"] += same
        if diff is None and len(ref.steps) == len(real.steps) and ref.ended == real.ended:
            totals["identical"] += 1
        else:
            failures.append(f"case {totals['configs']}: {case.config} ended {real.ended!r}: "
                            f"{diff.to_dict() if hasattr(diff, 'to_dict') else diff}")

    sweep()
    print(f"vllm@{args.version} vs reference, async scheduling + speculative decoding, "
          f"hypothesis seed {args.seed}: {totals['configs']} configs, {totals['identical']} identical; "
          f"{totals['identical_steps']}/{totals['steps']} steps identical; "
          f"{totals['preemptions']} preemptions, {totals['stale_spec_outputs']} stale speculative outputs; "
          f"violations: reference {totals['ref_violations']} cases {known['ref_violations']}, "
          f"vLLM {totals['vllm_violations']} cases {known['vllm_violations']}; "
          f"{time.monotonic() - start:.0f} s")
    for line in failures[:10]:
        print(line)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(page.run(main, "vllm_async_spec_sweep"))
