"""Where a command may write its output file (``-o``): refused before any work.

Every trace and scenario is written to a temp file beside its destination and
renamed over it (``harness/trace/writer.py``), so a destination that is not a
plain file would be *replaced*: ``-o /dev/full`` as root turned the device
node into a trace, ``-o`` naming the workload replaced the workload.
``check_output_file`` refuses, with one line naming the path and the problem
(``OutputPathError``, exit 2 in the CLI):

* an empty path;
* a path that exists and is not a regular file (a device, FIFO, socket or
  folder), or that is the same file as one of the command's inputs;
* a parent that exists but is not a folder (``-o some_file/x.parquet``), or
  a folder this process cannot write in;
* a file name too long for the file system, counting the temp file's
  (``.<name>.XXXXXXXX.tmp``, 14 characters more);
* a path ending in ``/`` (``-o x.parquet/``: a folder's name where a file
  is meant).

``check_output_folder`` does the same for a command writing into a folder
(``harness fuzz -o DIR``), before any work: a found failure was lost to
NotADirectoryError or FileExistsError once the fuzzing was done.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pyarrow as pa

#: Characters the temp file adds to the destination's name (tempfile.mkstemp in the writer).
TEMP_NAME_EXTRA = 14


class OutputPathError(ValueError):
    """``-o`` names a destination the command refuses; the message is one line."""


def _writable_ancestor(output: str, path: Path) -> Path:
    """The nearest existing folder at or above ``path`` (where the missing ones
    will be created); OutputPathError when it is not a folder or not writable."""
    ancestor = path
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutputPathError(f"{output}: {ancestor} is not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise OutputPathError(f"{output}: cannot write in {ancestor} (permission denied)")
    return ancestor


def _refuse_non_utf8(output: str, option: str) -> None:
    """A destination whose name is not valid UTF-8 is refused before any work:
    pyarrow writes through paths it encodes as UTF-8, so such a run ended
    after its work with a bare UnicodeEncodeError and left its folder behind
    (adversarial trial). Reading such a file works (``arrow_source``)."""
    try:
        output.encode("utf-8")
    except UnicodeEncodeError:
        raise OutputPathError(f"{utf8_path(output)}: {option} names a path that is not valid UTF-8; "
                              f"choose a UTF-8 name (such a file can be read, not written)") from None


def check_output_file(output: str, inputs: tuple[str, ...] = (), option: str = "-o") -> None:
    """Raise OutputPathError unless ``output`` can be written as a new or
    replaced regular file, and is none of ``inputs`` (paths that may not
    exist: a ``synthetic:N`` workload is no file). ``option``: the option
    the messages name (``--report`` for ``check --report FILE``, ...)."""
    if not output or not output.strip():
        raise OutputPathError(f"{option}: the output path is empty")
    _refuse_non_utf8(output, option)
    if output.endswith((os.sep, "/")) or output.endswith((f"{os.sep}.", f"{os.sep}..")) or output in (".", ".."):
        # Regression: `-o x.parquet/` was taken for x.parquet (pathlib drops the slash).
        raise OutputPathError(f"{output}: {option} names a folder (the path ends in '/'), not a file; "
                              f"drop the '/' or name a file in it")
    out = Path(output)
    try:
        st = os.stat(out)
    except FileNotFoundError:
        st = None
    except NotADirectoryError:
        st = None
    except OSError as exc:
        raise OutputPathError(f"{output}: cannot use as output: {exc.strerror or exc}") from None
    if st is not None:
        if not stat.S_ISREG(st.st_mode):
            kind = ("a folder" if stat.S_ISDIR(st.st_mode) else "a device" if stat.S_ISCHR(st.st_mode)
                    or stat.S_ISBLK(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode) else "not a regular file")
            raise OutputPathError(f"{output}: {option} names {kind}, not a regular file; refusing to replace it")
        for source in inputs:
            try:
                if os.path.samefile(source, out):
                    raise OutputPathError(f"{output}: {option} names the input file; it would be overwritten "
                                          f"(choose another path)")
            except OSError:
                continue
    ancestor = _writable_ancestor(output, out.parent)
    try:
        name_max = os.pathconf(ancestor, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    longest = max([len(os.fsencode(out.name)) + TEMP_NAME_EXTRA]
                  + [len(os.fsencode(p)) for p in out.parent.parts[len(ancestor.parts):]])
    if longest > name_max:
        raise OutputPathError(f"{output[:60]}...: file name too long ({len(os.fsencode(out.name))} bytes; "
                              f"this file system allows {name_max - TEMP_NAME_EXTRA} for a trace)")


def check_output_folder(output: str, files: tuple[str, ...] = ()) -> None:
    """Raise OutputPathError unless ``output`` is a folder (existing, or one
    that can be created: every existing ancestor a folder this process can
    write in) in which each of ``files`` (names inside it) can be written as
    a regular file (``check_output_file``).

    Regression (adversarial trial): ``harness fuzz -o FILE`` fuzzed for
    minutes and lost the finding to NotADirectoryError (or FileExistsError)
    when it came to write the witness."""
    if not output or not output.strip():
        raise OutputPathError("-o: the output folder is empty")
    _refuse_non_utf8(output, "-o")
    out = Path(output)
    for link in (out, *out.parents):  # a dangling link cannot be created through (FileExistsError)
        if link.is_symlink() and not link.exists():
            raise OutputPathError(f"{output}: {link} is a dangling symbolic link (to {os.readlink(link)}), "
                                  f"not a folder")
    try:
        st = os.stat(out)
    except (FileNotFoundError, NotADirectoryError):
        st = None
    except OSError as exc:
        raise OutputPathError(f"{output}: cannot use as output folder: {exc.strerror or exc}") from None
    if st is not None and not stat.S_ISDIR(st.st_mode):
        kind = "a file" if stat.S_ISREG(st.st_mode) else "a device, FIFO or socket"
        raise OutputPathError(f"{output}: -o names {kind}, not a folder (this command writes its files "
                              f"into a folder)")
    _writable_ancestor(output, out)
    for name in files:
        check_output_file(str(out / name))


def arrow_source(path: str | os.PathLike[str]) -> str | pa.BufferReader:
    """What to hand pyarrow to read ``path``: the path itself, or the file's
    bytes in a ``pa.BufferReader`` when the name is not valid UTF-8.

    pyarrow resolves a path through its file-system layer, which encodes the
    name as UTF-8: a name with an undecodable byte (``bad\\xffname.parquet``,
    held by Python as a lone surrogate) raised UnicodeEncodeError and a valid
    trace was refused as unreadable (adversarial trial). Python's own ``open``
    takes such names, so their bytes are read here instead; every other path
    goes to pyarrow unchanged (no copy). Raises OSError as ``open`` does.
    """
    name = os.fspath(path)
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        with open(name, "rb") as f:
            return pa.BufferReader(f.read())
    return name


def utf8_path(path: str | os.PathLike[str]) -> str:
    """``path`` as text a terminal can show: undecodable bytes as ``\\xNN``."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")
