"""The canonical scenarios: small workloads + configs that exercise one
feature each, one scenario file (docs/scenario-format.md) per scenario in
this folder. Goldens (golden/) are recordings of them; the mutation self-test
runs every mutant on every scenario; the conformance suite runs a candidate on
each.

A canonical scenario's file is named ``<name>.toml`` and has a one-line
``description``, a ``[config]`` and a ``[synthetic]`` table (the seeded
generator's arguments), so it is short to read and edit, and the workload it
builds is ``workloads.synthetic(**table)``: source ``synthetic``, the params and
their sha256, which is what the golden's metadata records. ``harness record
harness/scenarios/<name>.toml -o T.parquet`` therefore writes the golden's
bytes. A scenario is fully determined by its file: same file, same bytes.

``SCENARIOS`` (name -> :class:`Scenario`) is built once, at import, from the
``*.toml`` files here (package data: an installed harness ships them): first
the names of ``ORDER`` (the order the goldens, the mutation matrix and every
report have always listed them in), then any other file by name. A name in
``ORDER`` without its file, or a file that is not a valid canonical scenario,
raises :class:`~workloads.scenario.ScenarioError` (``file:line: problem``) at
import: a broken canonical set must not silently shrink what is checked.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from reference.config import EngineConfig
from reference.workload import Action, Workload
from workloads.scenario import ScenarioError, load_scenario, synthetic_workload

__all__ = ["ACTION_SCENARIOS", "ActionScenario", "DIRECTORY", "HYBRID_DIRECTORY", "HYBRID_SCENARIOS",
           "LORA_DIRECTORY", "LORA_SCENARIOS", "ORDER", "SCENARIOS", "Scenario", "load_canonical"]

#: The folder of the canonical scenario files (this package's).
DIRECTORY = Path(__file__).resolve().parent
#: The listing order of the canonical scenarios (files not named here follow, by name).
ORDER: tuple[str, ...] = (
    "fcfs-tight", "fcfs-roomy", "priority-tight", "prefix-sharing", "no-prefix-caching",
    "chunked-threshold", "no-chunked-prefill", "eos-stop-abort", "preemption-heavy", "spec-decode",
    "spec-decode-priority", "async-tight", "pipeline-3", "async-pipeline-3", "prefill-cadence",
    "dp2-throttle", "deferred-frees", "kv-connector", "encoder-inputs", "async-spec-decode",
)


@dataclass(frozen=True)
class Scenario:
    """A named, deterministic (workload, config, seed) triple, read from ``path``.

    ``config`` is the file's ``[config]`` table (EngineConfig keys, vLLM's
    names), ``workload`` its ``[synthetic]`` table (``workloads.synthetic``'s
    arguments as written; ``seed`` defaults to the scenario's), ``seed`` the
    scenario's (the scripted model's and, by default, the generator's).
    """

    name: str
    description: str
    config: dict[str, Any]
    workload: dict[str, Any]
    seed: int = 0
    path: Path | None = None

    def engine_config(self) -> EngineConfig:
        """The config, as ``harness record`` builds it from the file. Raises ConfigError."""
        return EngineConfig.from_dict(self.config)

    def make_workload(self) -> Workload:
        """The workload, as ``harness record`` builds it from the file
        (``workloads.scenario.synthetic_workload``). Raises WorkloadError."""
        return synthetic_workload(self.workload, self.seed)


def load_canonical(path: str | Path) -> Scenario:
    """Read one canonical scenario file (named after its scenario).

    Raises ScenarioError (``file:line: problem``) for anything
    ``load_scenario`` refuses, a file with ``[[requests]]`` instead of
    ``[synthetic]``, or a missing or multi-line ``description`` (the goldens'
    manifest and every report print it on one line).
    """
    p = Path(path)
    loaded = load_scenario(p)
    if loaded.synthetic is None:
        raise ScenarioError(f"{p}:1: a canonical scenario's workload is a [synthetic] table, not "
                            f"[[requests]]")
    if not loaded.description or "\n" in loaded.description:
        raise ScenarioError(f"{p}:1: a canonical scenario needs a one-line description")
    return Scenario(p.stem, loaded.description, loaded.config, loaded.synthetic, loaded.seed, p)


def _load_all(directory: Path) -> dict[str, Scenario]:
    files = {p.stem: p for p in directory.glob("*.toml")}
    missing = [name for name in ORDER if name not in files]
    if missing:
        raise ScenarioError(f"{directory / (missing[0] + '.toml')}:1: canonical scenario file missing "
                            f"(named in harness.scenarios.ORDER)")
    names = list(ORDER) + sorted(set(files) - set(ORDER))
    return {name: load_canonical(files[name]) for name in names}


SCENARIOS: dict[str, Scenario] = _load_all(DIRECTORY)

#: Hybrid models' scenarios (``sliding_window`` / ``layer_types``: several
#: KV-cache groups, trace schema 9), one canonical-format file each in
#: ``hybrid/``, by name. Kept apart from ``SCENARIOS``: their goldens are in
#: ``golden/hybrid/`` (``harness golden check --hybrid``) and the vLLM
#: candidates do not drive a hybrid KV-cache config yet, so the conformance
#: suite and the sweeps over SCENARIOS leave them out; the mutation
#: self-test runs them (``harness.mutation.MUTATION_SCENARIOS``).
HYBRID_DIRECTORY = DIRECTORY / "hybrid"
HYBRID_SCENARIOS: dict[str, Scenario] = {p.stem: load_canonical(p) for p in sorted(HYBRID_DIRECTORY.glob("*.toml"))}

#: LoRA scenarios (config ``max_loras`` and ``lora_int_ids``: requests on
#: adapters, at most ``max_loras`` distinct ones per step), one canonical-format
#: file each in ``lora/``, by name. Run by the mutation self-test
#: (``harness.mutation.MUTATION_SCENARIOS``: they alone can kill the
#: ``ignore-max-loras`` mutant), without goldens, as ``ACTION_SCENARIOS``: the
#: vLLM candidates' driver builds no LoRA config, so a golden of one could be
#: replayed by the reference alone (the conformance suite and the sweeps
#: leave them out too).
LORA_DIRECTORY = DIRECTORY / "lora"
LORA_SCENARIOS: dict[str, Scenario] = {p.stem: load_canonical(p) for p in sorted(LORA_DIRECTORY.glob("*.toml"))}


# -- scenarios with [[actions]] ------------------------------------------------------
@dataclass(frozen=True)
class ActionScenario(Scenario):
    """A canonical-style scenario plus ``actions`` (``reference.workload.Action``),
    also listed in the workload's ``params["actions"]`` so a recording replays
    them. Built in code: a ``[synthetic]`` file cannot carry ``[[actions]]``
    (their request ids and steps are checked against ``[[requests]]``)."""

    actions: tuple[Action, ...] = ()

    def make_workload(self) -> Workload:
        wl = super().make_workload()
        return replace(wl, actions=self.actions,
                       params={**wl.params, "actions": [a.to_dict() for a in self.actions]})


#: Scenarios with actions (prefix-cache resets, abort sets): run by the mutation
#: self-test beside ``SCENARIOS``, without goldens (the goldens stay the
#: recordings of ``SCENARIOS``). Their hand-written counterparts with exact
#: figures are traces/scenarios/reset-prefix-cache-*.toml.
_SMALL = {"block_size": 4, "max_model_len": 96, "max_num_seqs": 4, "max_num_batched_tokens": 64}
ACTION_SCENARIOS: dict[str, ActionScenario] = {s.name: s for s in [
    ActionScenario("prefix-reset", "prefix sharing with prefix-cache resets: refused while blocks are held "
                   "(step 5), forced (reset_running_requests: every running request preempted, tail first) "
                   "at steps 12 and 25, and an abort action at step 8",
                   {**_SMALL, "num_gpu_blocks": 60},
                   {"num_requests": 40, "shared_prefix_len": 32, "shared_prefix_fraction": 0.5},
                   actions=(Action(5, "reset_prefix_cache"),
                            Action(8, "abort", request_ids=("r000001", "r000002")),
                            Action(12, "reset_prefix_cache", reset_running_requests=True),
                            Action(25, "reset_prefix_cache", reset_running_requests=True))),
]}
