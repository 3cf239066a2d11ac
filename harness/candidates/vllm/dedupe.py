"""Hard-link the files that vLLM environments hold in common.

Every env the harness builds carries the same CPU torch 2.13.0 (754 MB
unpacked) and mostly the same pinned dependencies (about 0.5 GB): the full
venvs of ``env.SUPPORTED_VERSIONS``, the serving env, the shared layer of the
layered envs, and usually the harness's own virtual environment too. Byte for
byte the same files, written once per env, they filled a CI machine's disk
(issue 14's "environments share what they can"). After a build, each
non-empty file of the new env that has a twin (same path below
``site-packages``, same size, mode, owner and bytes) in a finished env on the
same file system is replaced by a hard link to that twin. What cannot be read
is no twin: this pass never fails a build.

Why hard links are safe here: pip never writes into an installed file; it
unlinks and writes anew (uninstall, upgrade), which leaves the other env's
link intact. Only complete envs are used as twins (their marker is written),
so a build running beside this one is never linked to half-written files.
"""

from __future__ import annotations

import filecmp
import os
import sysconfig
from collections.abc import Iterable
from pathlib import Path

#: Files smaller than this are left alone (bytes): only empty ones. The bulk
#: is in a few hundred shared libraries, but the 25,000 smaller twins of two
#: envs hold 0.24 GB more (a new user's trial), and linking them costs about
#: 10 s a build.
MIN_BYTES = 1


def site_packages(env: Path) -> list[Path]:
    """The ``site-packages`` folders of the venv at ``env`` (``[]`` if none)."""
    return sorted(p for p in env.glob("lib/python3*/site-packages") if p.is_dir())


def _listing(folder: Path) -> list[Path]:
    """``folder``'s entries, sorted; ``[]`` where it cannot be read (a
    ``lost+found``, another user's folder: such a place is no twin, and
    never a reason to throw a finished build away)."""
    try:
        return sorted(folder.iterdir())
    except OSError:
        return []


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:
        return False


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:
        return False


def finished_sites(roots: Iterable[Path], *, exclude: Path, marker: str) -> list[Path]:
    """Folders whose files may be linked to: the ``site-packages`` of every env
    under ``roots`` holding ``marker`` (a finished build), every finished
    shared layer (``<root>/.shared/<sha>/.complete``), and the harness's own
    interpreter's ``purelib``/``platlib``; never ``exclude`` (the env being
    built) or anything inside it. What cannot be read is left out."""
    found: list[Path] = []
    for root in roots:
        for child in _listing(root):
            if child == exclude or child.name.startswith(".tmp") or not _is_dir(child):
                continue
            if child.name == ".shared":
                found += [layer for layer in _listing(child) if _exists(layer / ".complete")]
            elif _exists(child / marker):
                found += site_packages(child)
    own = {Path(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")}
    found += sorted(p for p in own if p.is_dir())
    exclude = exclude.resolve()
    return [p for p in dict.fromkeys(found) if exclude not in p.resolve().parents and p.resolve() != exclude]


def _same_bytes(a: Path, b: Path) -> bool:
    try:
        return filecmp.cmp(a, b, shallow=False)
    except OSError:  # unreadable (another user's 0600 file): not a twin
        return False


def link_twins(site: Path, others: list[Path]) -> int:
    """Replace each file under ``site`` (at least ``MIN_BYTES``) that has a twin
    in one of ``others`` (same relative path, size, mode, owner and bytes, same
    file system) by a hard link to the twin; returns the bytes freed. The swap
    is atomic (link to a temporary name, then rename over the file), so the env
    is whole at every instant. A twin on another file system, owned by another
    user (who could then change code this env runs), or any OSError on a file,
    leaves that file as it was."""
    freed = 0
    tmp = site / f".sched-harness-link-{os.getpid()}"  # short: a long file name plus a suffix can pass 255 bytes
    for dirpath, _dirs, files in os.walk(site):
        for name in files:
            path = Path(dirpath, name)
            try:
                st = path.lstat()
            except OSError:
                continue
            if not path.is_file() or path.is_symlink() or st.st_size < MIN_BYTES or st.st_nlink > 1:
                continue
            rel = path.relative_to(site)
            for other in others:
                twin = other / rel
                try:
                    tst = twin.lstat()
                except OSError:
                    continue
                if (tst.st_dev != st.st_dev or tst.st_size != st.st_size or tst.st_mode != st.st_mode
                        or tst.st_uid != st.st_uid or twin.is_symlink() or not _same_bytes(path, twin)):
                    continue
                try:
                    os.link(twin, tmp)
                    os.replace(tmp, path)
                except OSError:
                    try:
                        tmp.unlink(missing_ok=True)
                    except OSError:
                        pass
                    continue
                freed += st.st_blocks * 512
                break
    return freed


def share_with_finished_envs(target: Path, sites: list[Path], roots: Iterable[Path], *, marker: str) -> int:
    """Hard-link ``sites`` (the new env's package folders; the env at
    ``target``) to their twins in the finished envs of ``roots``; returns the
    bytes freed (0 where nothing matches, e.g. on another file system)."""
    if not sites:
        return 0
    others = finished_sites(roots, exclude=target, marker=marker)
    return sum(link_twins(site, others) for site in sites)
