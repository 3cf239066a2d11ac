"""The layout's rules, read from the source with ``ast`` (nothing is imported).

- Imports go downward only: ``reference`` (vLLM's semantics) never imports the
  harness or the workloads; ``workloads`` never imports the harness;
  ``harness.trace`` never imports the checks, the candidates or the tools;
  ``harness.check`` never imports the candidates or the tools (a verdict
  depends on the trace alone, not on which engine made it); ``harness.candidates``
  never imports the checks or the tools. Lazy imports inside functions count
  too: they are dependencies all the same.
- The modules that run inside a vLLM environment (``driver`` and its
  ``driver_*`` modules, ``events``, and ``recording_scheduler`` at import
  time) import only the standard library and vLLM, because that environment
  has none of our dependencies.
- Every folder says, in a README.md or its package docstring, what lives there
  and what it may import.
- Every repository path that README.md, docs/ and the folder READMEs mention exists.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("reference", "workloads", "harness")
# The tool modules: each is one command or plugin over the layers below it.
TOOLS = ("harness.cli", "harness.cli_common", "harness.check_cli", "harness.convert_cli", "harness.record_cli", "harness.replay_cli",
         "harness.golden_cli", "harness.fuzz_cli", "harness.vllm_env_cli", "harness.fuzz", "harness.golden", "harness.mutation", "harness.replay", "harness.diff",
         "harness.conformance", "harness.pytest_plugin", "harness.outputs", "harness.view", "harness.corpus",
         "harness.corpus_ray", "harness.ray_cluster")

# importer prefix -> imported prefixes it must never import.
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "reference": ("harness", "workloads"),
    "workloads": ("harness",),
    "harness.trace": ("harness.check", "harness.candidates", *TOOLS),
    "harness.check": ("harness.candidates", *TOOLS),
    "harness.candidates": ("harness.check", *TOOLS),
}

# Folders and where their one paragraph lives.
FOLDERS = ("reference", "reference/runners", "workloads", "harness", "harness/trace", "harness/check",
           "harness/candidates", "harness/candidates/vllm", "harness/view", "harness/serve", "tests", "bench", "golden", "traces", "docs")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for top in PACKAGES for p in sorted((ROOT / top).rglob("*.py"))}


def _imports(path: Path, top_level_only: bool = False) -> list[tuple[int, str]]:
    """(line, module) for every import in ``path``; ``from a import b`` yields
    both ``a`` and ``a.b`` (``b`` may be a submodule). Relative imports are
    resolved against the module's package. ``top_level_only`` skips imports
    inside function bodies."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if top_level_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if isinstance(child, ast.Import):
                found.extend((child.lineno, a.name) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = package[:len(package) - child.level + 1] if child.level else []
                module = ".".join([*base, *([child.module] if child.module else [])])
                found.append((child.lineno, module))
                found.extend((child.lineno, f"{module}.{a.name}") for a in child.names)
            visit(child)

    visit(tree)
    return found


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_the_scan_sees_every_package_and_its_imports() -> None:
    modules = _modules()
    # The scan itself must work, or the rules below would pass vacuously.
    assert {"reference.scheduler", "workloads.azure", "harness.trace.reader", "harness.check.checker",
            "harness.candidates.mutants", "harness.candidates.vllm.driver", *TOOLS} <= set(modules)
    assert "reference.scheduler" in {m for _, m in _imports(modules["harness.candidates.mutants"])}
    # A lazy import inside a function is seen; `from harness.check import x` yields both names.
    assert {"harness.outputs", "harness.check", "harness.check.check_trace"} <= {
        m for _, m in _imports(modules["harness.record_cli"]) + _imports(modules["harness.cli_common"])}
    assert "harness.outputs" not in {m for _, m in _imports(modules["harness.record_cli"], top_level_only=True)}


def test_imports_only_go_downward() -> None:
    violations = []
    for name, path in _modules().items():
        for importer, banned in FORBIDDEN.items():
            if not _under(name, importer):
                continue
            for line, module in _imports(path):
                hit = next((b for b in banned if _under(module, b)), None)
                if hit is not None:
                    violations.append(f"{path.relative_to(ROOT)}:{line}: {name} imports {module} "
                                      f"({importer} must not import {hit})")
    assert violations == []


#: The driver's modules beside driver.py (loaded by it from their folder: stdlib and vLLM only).
DRIVER_MODULES = tuple(sorted(p.stem for p in (ROOT / "harness" / "candidates" / "vllm").glob("driver_*.py")))


def _outside_stdlib(path: Path, top_level_only: bool) -> list[str]:
    # msgspec: a vLLM dependency (the recording scheduler's encoder, with a json fallback).
    allowed = set(sys.stdlib_module_names) | {"vllm", "torch", "msgspec", "__future__"}
    return sorted({f"{path.name}:{line}: {m}" for line, m in _imports(path, top_level_only)
                   if m.split(".")[0] not in allowed
                   and not _under(m, "harness.candidates.vllm.events")
                   and not any(_under(m, f"harness.candidates.vllm.{d}") for d in DRIVER_MODULES)
                   and m not in ("harness.candidates.vllm", "harness.candidates", "harness")})


def test_modules_run_inside_vllm_import_only_stdlib_and_vllm() -> None:
    vllm_dir = ROOT / "harness" / "candidates" / "vllm"
    assert _outside_stdlib(vllm_dir / "driver.py", top_level_only=False) == []
    assert len(DRIVER_MODULES) >= 9  # the driver's modules are seen (driver_engine_core, ...)
    for name in DRIVER_MODULES:
        assert _outside_stdlib(vllm_dir / f"{name}.py", top_level_only=False) == [], name
    assert _outside_stdlib(vllm_dir / "events.py", top_level_only=False) == []
    # The writing side entirely (its reader, recording_convert.py, runs in the harness).
    assert _outside_stdlib(vllm_dir / "recording_scheduler.py", top_level_only=False) == []


def _folder_paragraph(folder: str) -> str:
    readme = ROOT / folder / "README.md"
    if readme.exists():
        return readme.read_text()
    init = ROOT / folder / "__init__.py"
    assert init.exists(), f"{folder}/ has neither README.md nor __init__.py"
    return ast.get_docstring(ast.parse(init.read_text())) or ""


@pytest.mark.parametrize("folder", FOLDERS)
def test_every_folder_says_what_lives_there_and_what_it_may_import(folder: str) -> None:
    text = _folder_paragraph(folder)
    assert len(text.split()) >= 30, f"{folder}/: no paragraph saying what lives there"
    assert re.search(r"\bimport", text), f"{folder}/: does not say what it may import"


def test_top_level_docstrings_state_the_layout_and_the_import_rule() -> None:
    harness_doc = _folder_paragraph("harness")
    reference_doc = _folder_paragraph("reference")
    for folder in ("harness/trace", "harness/check", "harness/candidates", "workloads", "reference/runners"):
        assert f"{folder.split('/')[-1]}" in harness_doc, folder
    assert "never imports" in harness_doc and "never imports" in reference_doc
    assert "runners" in reference_doc


# A repository path in backticks: starts with one of the repository's top-level folders (vLLM's
# own paths such as `vllm/v1/core/sched/scheduler.py` or bare file names are not ours to check).
_ROOTS = ("reference", "workloads", "harness", "tests", "bench", "golden", "traces", "docs")
_PATH = re.compile(r"`((?:%s)(?:/[\w.-]+)*/?)`" % "|".join(_ROOTS))
_SHARED = re.compile(r"`(\.\./shared/[\w./-]+)`")


def test_every_path_the_docs_mention_exists() -> None:
    docs = dict.fromkeys([ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
            *sorted(ROOT / f / "README.md" for f in FOLDERS if (ROOT / f / "README.md").exists())])
    assert len(docs) >= 7  # README.md, docs/ and the folder READMEs (tests, bench, golden, traces)
    shared_here = (ROOT.parent / "shared").is_dir()
    missing = []
    for doc in docs:
        text = doc.read_text()
        paths = set(_PATH.findall(text)) | (set(_SHARED.findall(text)) if shared_here else set())
        missing += [f"{doc.relative_to(ROOT)}: {path}" for path in sorted(paths) if not (ROOT / path).exists()]
    assert missing == []


def test_the_path_scan_finds_paths() -> None:
    text = "see `harness/check/` and `reference/engine.py`, not `vllm/v1/core/sched/scheduler.py` or `x.py`"
    assert set(_PATH.findall(text)) == {"harness/check/", "reference/engine.py"}
