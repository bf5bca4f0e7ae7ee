"""Output files written whole or not at all.

A results file that a Ctrl-C, a SIGTERM or a full disk cuts short reads as a
valid, shorter one (a JSONL trace with fewer requests) or as a broken one (a
PNG with no end), and it has already replaced the file a user had there.  So
outputs are written into a file beside their path and renamed over it at the
end (a rename within one directory is atomic): an interrupted write leaves
the earlier file as it was.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterator


def is_stdout(path: str | Path | None) -> bool:
    """Whether ``path`` is this process's standard output: /dev/stdout, or the
    file or pipe the shell sent it to."""
    if not path:
        return False
    try:
        return os.path.samestat(os.stat(path), os.fstat(1))
    except OSError:
        return False


@contextlib.contextmanager
def written_whole(path: str | Path) -> Iterator[str]:
    """Yield the path to write ``path``'s content to; on a clean exit it becomes
    ``path``, on any exception it is removed and ``path`` is left untouched.

    Standard output gets the content through the process's own descriptor, after
    what was printed before it: opened anew by its name (/dev/stdout) a file the
    shell redirected it to would be emptied, or renamed over (``>> log``).
    Anything else but a regular file (a pipe, a device) is written where it is:
    renaming over it would replace the device with a file.  A symbolic link
    keeps pointing where it did: its target is the file replaced.  The partial
    file has ``path``'s extension, and no other, since writers such as
    matplotlib pick a format by it."""
    if is_stdout(path):
        handle, partial = tempfile.mkstemp(prefix="kvgate-", suffix=os.path.splitext(str(path))[1])
        os.close(handle)
        try:
            yield partial
            for stream in (sys.stdout, sys.__stdout__):
                if stream is not None:
                    stream.flush()
            with open(partial, "rb") as content, os.fdopen(os.dup(1), "wb") as out:
                shutil.copyfileobj(content, out)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(partial)
        return
    if os.path.exists(path) and not os.path.isfile(path):
        yield str(path)
        return
    final = os.path.realpath(path)
    root, ext = os.path.splitext(final)
    partial = f"{root}-partial-{os.getpid()}{ext}"  # no dot added: "curve" has no extension, nor has this
    try:
        yield partial
        if os.path.exists(final):
            shutil.copymode(final, partial)  # a file made read-only for the group stays so
        os.replace(partial, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise
