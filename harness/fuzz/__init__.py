"""Property-based fuzzing of a candidate scheduler (issue 7).

Hypothesis generates small engine configs and workloads whose correct
decisions are unambiguous (``strategies``: ``fuzz_cases`` and the
``FuzzCase`` it draws). Each case runs in memory on the reference and on the
candidate; every invariant is checked and, for a candidate other than the
reference, its rows are compared step by step with the reference's; the
first failure is shrunk by hypothesis (``run``: ``evaluate``, ``fuzz``, the
known reference findings). ``parallel.fuzz_parallel`` runs several such
searches in worker processes (worker i seeded with ``worker_seed(seed, i)``,
an equal share of the examples each) and ``witness.write_witnesses`` writes
each worker's shrunk case to a folder as a replayable Parquet trace plus a
JSON description; ``report`` renders what ``harness fuzz`` prints.

Imports go downward: ``strategies`` needs only ``reference``; ``run`` adds
``harness.check``, ``harness.trace`` and ``harness.replay``; ``parallel``
builds on ``run``; ``witness`` on both; ``report`` on ``witness``. This
package re-exports the public names, so ``from harness.fuzz import fuzz,
FuzzCase, ...`` works as before the split.
"""

from harness.fuzz.strategies import (DRAFT_BEHAVIOURS, KV_LOAD_FAILURE_RATES, KV_STORE_FRACTIONS,
                                     MAX_PROMPT, MAX_REQUESTS, MM_ITEM_BASE, TIME_QUANTUM, FuzzCase,
                                     encoder_setups, engine_configs, fuzz_cases, kv_connector_settings,
                                     mm_item_tokens, request_specs)
from harness.fuzz.run import (KNOWN_REFERENCE_FINDINGS, Failure, FuzzResult, Run, evaluate, fuzz,
                              known_reference_finding, run_case)
from harness.fuzz.parallel import (MAX_WORKERS, FuzzWorkerError, ParallelFuzzResult, WorkerProgress,
                                   WorkerResult, available_cpus, fuzz_parallel, split_examples,
                                   worker_seed)
from harness.fuzz.witness import Witness, write_failure, write_witnesses

__all__ = [
    "DRAFT_BEHAVIOURS", "KV_LOAD_FAILURE_RATES", "KV_STORE_FRACTIONS", "MAX_PROMPT", "MAX_REQUESTS",
    "MM_ITEM_BASE", "TIME_QUANTUM", "FuzzCase", "encoder_setups", "engine_configs", "fuzz_cases",
    "kv_connector_settings", "mm_item_tokens", "request_specs",
    "KNOWN_REFERENCE_FINDINGS", "Failure", "FuzzResult", "Run", "evaluate", "fuzz",
    "known_reference_finding", "run_case",
    "MAX_WORKERS", "FuzzWorkerError", "ParallelFuzzResult", "WorkerProgress", "WorkerResult",
    "available_cpus", "fuzz_parallel", "split_examples", "worker_seed",
    "Witness", "write_failure", "write_witnesses",
]
