"""A fast look for a misspelled ``scheduler_cls``, before vLLM is started.

``vllm@X,scheduler_cls=package.module:Class`` is checked for real by building
the class in a driver (``probe_scheduler_class``), which imports vLLM first:
about a minute on a cold machine. A typo in the module or class name, the
commonest mistake, was reported only then, and with no suggestion
(new-user trial). This look takes a fraction of a second: in the target's
interpreter, with the driver's ``PYTHONPATH`` and folder, it finds the
module's file level by level (``PathFinder``: no package is imported, no
module run) and reads the names its top level may bind (``ast``), then says
what is missing, with a "did you mean" among the classes it defines.

It only ever reports a name that is certainly absent. Whatever could bind
names at run time makes it pass, and the driver's full check decides: a
package ``__init__`` touching ``__path__`` or ``sys.modules``; a module using
``globals()``, ``vars()``, ``setattr``, ``exec``, ``sys.modules``, a
``global`` statement, an assignment expression, ``from x import *`` or a
module ``__getattr__``; a C extension; a name that is a submodule.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile

from harness.candidates.vllm.spec import VLLMTarget

#: Seconds for the look (one interpreter start, no vLLM import).
PRECHECK_TIMEOUT_S = 30.0

# Run in the target's interpreter: argv[1] is module:attr. Prints one JSON
# object: {"error": "..."} or {}. Standard library only. It sees the driver's
# path, not the caller's folder (``-c`` puts "" first on sys.path: a stale
# module there was read instead of the user's, a false refusal), and it locates
# modules with PathFinder, which imports nothing (find_spec imported every
# parent package: a vLLM fork's ``vllm.…`` took 30 s).
_SCRIPT = r"""
import ast, difflib, json, os, sys
from importlib.machinery import PathFinder
sys.path[:] = [p for p in sys.path if p not in ("", ".", os.getcwd())]
name = sys.argv[1]
module, sep, attr = name.partition(":")
if not sep:
    module, _, attr = name.rpartition(".")
def near(word, words, prefix=""):
    found = difflib.get_close_matches(word, sorted(set(words)), n=1, cutoff=0.6)
    return f" (did you mean {prefix + found[0]!r}?)" if found else ""
def out(obj):
    print(json.dumps(obj)); sys.exit(0)
def names_on(paths):
    found = set()
    for folder in paths:
        try:
            entries = os.listdir(folder)
        except OSError:
            continue
        for e in entries:
            stem = e.split(".")[0]
            if stem.isidentifier() and (e.endswith(".py") or os.path.isdir(os.path.join(folder, e))):
                found.add(stem)
    return found
def dynamic(source):
    # A package __init__ that may add modules or names at run time.
    return any(w in source for w in ("__path__", "sys.modules", "extend_path", "__getattr__"))
parts = module.split(".")
paths, spec, prefix = None, None, ""
for depth, part in enumerate(parts):
    prefix = ".".join(parts[:depth + 1])
    try:
        spec = PathFinder.find_spec(prefix, paths)
    except Exception:
        out({})
    if spec is None and depth == 0:
        # another finder (an editable install's, a zip) may provide the top level
        for finder in sys.meta_path:
            if finder is PathFinder or not hasattr(finder, "find_spec"):
                continue
            try:
                if finder.find_spec(prefix, None) is not None:
                    out({})
            except Exception:
                out({})
    if spec is None:
        if depth == 0:
            hint = near(prefix, names_on([p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])) \
                or " (is its folder on PYTHONPATH?)"
        else:
            hint = near(part, names_on(paths or []), ".".join(parts[:depth]) + ".")
        missing = "" if prefix == module else f": no module {prefix!r}"
        out({"error": f"module {module!r} is not found on this interpreter's path{missing}{hint}"})
    if depth < len(parts) - 1:
        init = spec.origin or ""
        if spec.submodule_search_locations is None:
            out({})  # a module used as a package: let the import decide
        if init.endswith(".py"):
            try:
                if dynamic(open(init, encoding="utf-8", errors="replace").read()):
                    out({})
            except OSError:
                out({})
        paths = list(spec.submodule_search_locations)
origin = spec.origin or ""
if not origin.endswith(".py"):
    out({})
try:
    source = open(origin, encoding="utf-8").read()
    tree = ast.parse(source)
except Exception:
    out({})
# Anything that can bind a module attribute at run time makes absence uncertain.
for n in ast.walk(tree):
    if isinstance(n, (ast.Global, ast.NamedExpr)):
        out({})
    if isinstance(n, ast.Name) and n.id in ("globals", "vars", "setattr", "exec", "eval", "__import__",
                                            "__getattr__", "__dict__"):
        out({})
    if isinstance(n, ast.Attribute) and n.attr in ("modules", "__dict__", "__setattr__"):
        out({})
    if isinstance(n, ast.alias) and n.name == "*":
        out({})
defined = set()
for node in tree.body:
    # what the module's top level (any branch of an if/try/with/for) may bind
    for n in ast.walk(node):
        if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            defined.add(n.name)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            defined.add(n.id)
        elif isinstance(n, ast.alias):
            defined.add((n.asname or n.name).split(".")[0])
head = attr.split(".")[0]
if head in defined or "__getattr__" in defined:
    out({})
if os.path.basename(origin) == "__init__.py" and head in names_on([os.path.dirname(origin)]):
    out({})  # a submodule, bound once imported
top_classes = [n.name for n in tree.body if isinstance(n, ast.ClassDef)]
out({"error": f"module {module!r} ({origin}) defines no {head!r}{near(head, top_classes)}"})
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
    try:  # in the driver's folder (tempdir), with the driver's PYTHONPATH
        done = subprocess.run([str(target.python), "-c", _SCRIPT, target.scheduler_cls], env=env,
                              cwd=tempfile.gettempdir(),
                              capture_output=True, text=True, timeout=PRECHECK_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
        answer = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {}
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
    error = answer.get("error") if isinstance(answer, dict) else None
    return f"scheduler_cls {target.scheduler_cls}: {error}" if error else None
