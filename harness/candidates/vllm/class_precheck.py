"""A fast look for a misspelled ``scheduler_cls``, before vLLM is started.

``vllm@X,scheduler_cls=package.module:Class`` is checked for real by building
the class in a driver (``probe_scheduler_class``), which imports vLLM first:
about a minute on a cold machine. A typo in the module or class name, the
commonest mistake, was reported only then, and with no suggestion
(new-user trial). This look takes a fraction of a second: in the target's
interpreter, with the driver's ``PYTHONPATH``, it finds the module's file
(``importlib.util.find_spec``: the module itself is not run) and reads the
class names defined at its top level (``ast``), then says what is missing
with a "did you mean".

It only ever reports a name that is certainly absent: a module that cannot be
looked at this way (a parent package that fails to import, a C extension, a
module with ``from x import *`` or a module-level ``__getattr__``) passes, and
the driver's full check decides.
"""

from __future__ import annotations

import json
import os
import subprocess

from harness.candidates.vllm.spec import VLLMTarget

#: Seconds for the look (one interpreter start, no vLLM import).
PRECHECK_TIMEOUT_S = 30.0

# Run in the target's interpreter: argv[1] is module:attr. Prints one JSON
# object: {"error": "..."} or {}. Standard library only.
_SCRIPT = r"""
import ast, difflib, importlib.util, json, os, pkgutil, sys
name = sys.argv[1]
module, sep, attr = name.partition(":")
if not sep:
    module, _, attr = name.rpartition(".")
def near(word, words):
    found = difflib.get_close_matches(word, sorted(set(words)), n=1, cutoff=0.6)
    return f" (did you mean {found[0]!r}?)" if found else ""
def out(obj):
    print(json.dumps(obj)); sys.exit(0)
parts = module.split(".")
spec = None
for depth in range(1, len(parts) + 1):  # the first level of the dotted name that is missing
    prefix = ".".join(parts[:depth])
    try:
        spec = importlib.util.find_spec(prefix)
    except Exception:
        out({})  # a package that fails to import: the driver reports it in full
    if spec is None:
        parent = ".".join(parts[:depth - 1])
        if parent:
            paths = list(importlib.util.find_spec(parent).submodule_search_locations or [])
            names = [parent + "." + m.name for m in pkgutil.iter_modules(paths)]
        else:
            extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
            names = [m.name for m in pkgutil.iter_modules(extra or None)]
        missing = "" if prefix == module else f": no module {prefix!r}"
        hint = near(prefix, names) or ("" if parent else " (is its folder on PYTHONPATH?)")
        out({"error": f"module {module!r} is not found on this interpreter's path{missing}{hint}"})
origin = spec.origin or ""
if not origin.endswith(".py"):
    out({})
try:
    tree = ast.parse(open(origin, encoding="utf-8").read())
except Exception:
    out({})
defined, classes = set(), []
for node in tree.body:
    if isinstance(node, ast.ClassDef):
        defined.add(node.name); classes.append(node.name)
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        defined.add(node.name)
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
        for a in node.names:
            if a.name == "*":
                out({})
            defined.add((a.asname or a.name).split(".")[0])
    elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for t in targets:
            for n in ast.walk(t):
                if isinstance(n, ast.Name):
                    defined.add(n.id)
    elif not isinstance(node, ast.Expr):
        # if/try/with/for at top level: whatever any branch may bind counts as defined
        for n in ast.walk(node):
            if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                defined.add(n.name)
                if isinstance(n, ast.ClassDef):
                    classes.append(n.name)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                defined.add(n.id)
            elif isinstance(n, ast.alias):
                if n.name == "*":
                    out({})
                defined.add((n.asname or n.name).split(".")[0])
if "__getattr__" in defined:
    out({})
head = attr.split(".")[0]
if head not in defined:
    out({"error": f"module {module!r} ({origin}) defines no {head!r}{near(head, classes or defined)}"})
out({})
"""


def precheck_scheduler_class(target: VLLMTarget) -> str | None:
    """The one-line reason ``target.scheduler_cls`` certainly cannot be found
    (module not on the path, or no such name at the module's top level, each
    with a "did you mean"), or None when it may be there (the driver's full
    check, ``probe_scheduler_class``, decides). Runs ``target.python`` once
    with the driver's ``PYTHONPATH``, without importing the module or vLLM;
    a look that fails or overruns ``PRECHECK_TIMEOUT_S`` is None."""
    if not target.scheduler_cls:
        return None
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if target.pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(target.pythonpath)
    try:
        done = subprocess.run([str(target.python), "-c", _SCRIPT, target.scheduler_cls], env=env,
                              capture_output=True, text=True, timeout=PRECHECK_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
        answer = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {}
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
    error = answer.get("error") if isinstance(answer, dict) else None
    return f"scheduler_cls {target.scheduler_cls}: {error}" if error else None
