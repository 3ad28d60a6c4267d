"""The --out folder: checked before a run, locked while one writes in it, and files written whole (temp + rename)."""
from __future__ import annotations

import contextlib
import datetime
import errno
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import Callable

try:                       # POSIX; on Windows runs are not locked (nothing else changes)
    import fcntl
except ImportError:        # pragma: no cover
    fcntl = None

LOCK_NAME = "mpedu.lock"


class OutFolderError(ValueError):
    """--out cannot be used: not a folder, not writable, or another run holds it."""


class WriteFailed(OSError):
    """A file in --out could not be written (disk full, file-size limit); the message says what was kept."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


def temp_prefix(path: Path) -> str:
    return f".{path.name}."


class _Recording:
    """A file that remembers the first OSError of a write: torch.save turns it into a RuntimeError
    ("[enforce fail at inline_container.cc]"), which no longer says "disk full" or "file too large"."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data):
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def __getattr__(self, name):     # flush, tell, fileno, ...: the file's own
        return getattr(self.f, name)


def atomic_write(path, write: Callable, *, binary: bool = True) -> None:
    """Call write(file) on a temp file in the same folder, fsync, then rename it onto `path`.

    Readers see the old file or the new one, never half of one; a symlink planted at `path`
    is replaced, never followed (rename acts on the name); the temp name is created with
    O_EXCL (mkstemp), so a planted one is not followed either. A failed write (disk full,
    file-size limit) raises OSError naming `path`, and the old file stays as it was.
    """
    path = Path(path)
    if not path.parent.is_dir():        # else mkstemp's error would name the temp file, not the folder
        raise FileNotFoundError(errno.ENOENT, f"no folder {path.parent} to write {path.name} into", str(path))
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=temp_prefix(path), suffix=".tmp")
    try:
        with contextlib.suppress(OSError):     # mkstemp's 0600 would hide the file from the user's group
            os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb" if binary else "w") as f:
            recorder = _Recording(f)
            try:
                write(recorder)
            except OSError:
                raise
            except Exception as e:          # a library that wraps the OSError of the write
                if recorder.error is None:
                    raise
                raise recorder.error from e
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable (POSIX; not possible on Windows)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _umask() -> int:
    """The process's umask (read by setting it and putting it back: there is no other portable way)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def why(e: OSError) -> str:
    """An OSError in a few words, with the usual cause of a failed write."""
    text = e.strerror or str(e)
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        text += " (the disk is full, or a quota or file-size limit was reached)"
    return text


# ---------------------------------------------------------------- the folder

def prepare_out(out) -> Path:
    """Create --out if need be and check it is a folder this process can write in, before any training."""
    out = Path(out)
    above = next((p for p in [out, *out.parents] if p.exists()), None)
    if above is not None and not above.is_dir():
        where = "is a file" if above == out else f"is inside {above}, which is a file"
        raise OutFolderError(f"--out {out} {where}, not a folder; pick a folder (it is created if missing)")
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=out, prefix=".mpedu-write-test.")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:                 # (e.filename would name the probe, a temp file of ours)
        raise OutFolderError(f"cannot write in --out {out}: {why(e)}; pick a folder you can write in") from None
    for name in ("checkpoint.pt", "model.pt"):      # what a run writes there: a folder of that name would stop it
        if (out / name).exists() and not (out / name).is_file():
            raise OutFolderError(f"--out {out} holds {name} that is not a file (a folder?); mpedu writes its "
                                 f"{name} there: move it away, or pick another --out")
    return out


def _holder(text: str) -> dict:
    fields = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    try:
        fields["pid"] = int(fields.get("pid", ""))
    except ValueError:
        fields.pop("pid", None)
    return fields


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:      # someone else's process: it exists
        return True
    return True


class OutLock:
    """An exclusive lock on `out/mpedu.lock` while a run writes in `out`.

    flock, so the kernel drops it when the holder dies (even by kill -9): a later run then
    finds the holder's pid in the file but gets the lock, and says it took it over. The file
    holds the holder's pid, start time and command, so a refused run can name it.
    Re-entrant in the thread that holds it (the command line locks --out, then its train() does
    too); any other thread or process is refused.
    """

    _held: dict = {}                 # lock file -> (thread holding it, how many times)
    _guard = threading.Lock()

    def __init__(self, out, log=print):
        self.path, self.log, self.fd = Path(out) / LOCK_NAME, log, None
        self._key = os.path.realpath(self.path)

    def __enter__(self) -> "OutLock":
        if fcntl is None:        # pragma: no cover
            return self
        with OutLock._guard:
            thread, count = OutLock._held.get(self._key, (None, 0))
            if thread == threading.get_ident():
                OutLock._held[self._key] = (thread, count + 1)
                return self
            self._take()
            OutLock._held[self._key] = (threading.get_ident(), 1)
        return self

    def _take(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
        except OSError as e:
            extra = "; it is a symbolic link, which mpedu does not follow: remove it" if e.errno == errno.ELOOP else ""
            raise OutFolderError(f"cannot open the lock file {self.path}: {why(e)}{extra}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _holder(os.pread(fd, 4096, 0).decode("utf-8", "replace"))
            os.close(fd)
            who = (f"pid {holder['pid']}" if "pid" in holder else "another process") + \
                (f", started {holder['started']}" if "started" in holder else "") + \
                (f": {holder['command']}" if "command" in holder else "")
            raise OutFolderError(f"--out {self.path.parent} is in use by another mpedu run ({who}); wait for it "
                                 "to finish, or pick another --out") from None
        old = _holder(os.pread(fd, 4096, 0).decode("utf-8", "replace"))
        if "pid" in old:          # the last holder ended without releasing: killed, or its machine stopped
            state = "is no longer running" if not _alive(old["pid"]) else "no longer holds it"
            self.log(f"note: {self.path} names pid {old['pid']}, which {state}; taking the lock over")
        started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        command = " ".join([Path(sys.executable).name, *sys.argv]).replace("\n", " ")[:500]
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid={os.getpid()}\nstarted={started}\ncommand={command}\n".encode(), 0)
        self.fd = fd

    def __exit__(self, *exc) -> None:
        if fcntl is None:        # pragma: no cover
            return
        with OutLock._guard:
            thread, count = OutLock._held.pop(self._key, (None, 1))
            if count > 1:                        # an inner hold of the same thread: the outer one keeps it
                OutLock._held[self._key] = (thread, count - 1)
                return
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, 0)     # emptied, not removed: removing would race with a waiting run
            os.close(self.fd)                # closing releases the flock
            self.fd = None
