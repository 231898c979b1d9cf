"""One run at a time in a run folder: ``longqa train`` holds ``<trainer.output_dir>/run.lock`` while it runs.

Two runs writing one folder replace each other's metrics.jsonl and checkpoints, or delete the checkpoint the other
is writing, and both may still end with status 0. So a run takes the folder's lock at its start, before anything
is written there, and gives it back at its end; a run that finds it held by a live run stops in one line naming
that run (its host, process id and start time).

A run that crashed (SIGKILL, a lost node) leaves its lock behind, which must not block the folder for ever. A lock
is stale, and taken over with a line saying so:

- on this machine (the same host name, the same boot and the same process-id namespace, so that its process id
  means the same process here), when its process is gone, or its id now names a process started later;
- from another host, whose processes cannot be looked at from here, when it was not refreshed for ``STALE_S``
  seconds: the holder touches it every ``REFRESH_S`` seconds while it runs.

The processes of one job share it. Under torchrun rank 0 alone takes it (the other ranks write into the folder
only in the collective checkpoint saves that rank 0 joins). Under ``trainer.launcher=ray`` the driver takes it and
hands its token to the workers, whose rank 0 recognises it in the lock rather than finding it held.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from longqa.config import ConfigError

__all__ = ["LOCK_FILE", "REFRESH_S", "STALE_S", "RunFolderBusy", "hold_run_folder"]

LOCK_FILE = "run.lock"
REFRESH_S = 60.0  # how often a run touches its lock
STALE_S = 600.0  # a lock from another host not touched for this long was left by a run that is gone


class RunFolderBusy(ConfigError):
    """``trainer.output_dir`` is held by another live run (or its lock will not settle): that run must end, or this
    one be given another folder. A ``ConfigError``, reported in one line."""


def _read_text(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _machine() -> list[str | None]:
    """What makes a process id mean the same process: the kernel's boot and the process-id namespace."""
    namespace = None
    with contextlib.suppress(OSError):
        namespace = os.readlink("/proc/self/ns/pid")
    return [_read_text("/proc/sys/kernel/random/boot_id"), namespace]


def _process_start(pid: int) -> str | None:
    """When process ``pid`` started, in clock ticks since boot (None where /proc does not say): a process id that
    names a process started later was reused."""
    stat = _read_text(f"/proc/{pid}/stat")
    return stat.rpartition(")")[2].split()[19] if stat else None


def _alive(pid: int, started: str | None) -> bool:
    """Whether process ``pid`` of this machine still runs and is the one that started at ``started``."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (another user's process: it exists)
        pass
    now = _process_start(pid)
    return started is None or now is None or now == started


def _this_run(token: str) -> dict:
    pid = os.getpid()
    return {
        "host": socket.gethostname(),
        "pid": pid,
        "started": time.time(),
        "token": token,
        "machine": _machine(),
        "process_start": _process_start(pid),
    }


def _describe(holder: dict) -> str:
    """``host H, pid P, started 2025-06-01 12:00:03``, or what the lock does not say."""
    if not holder:
        return "a run its lock does not name (the lock file is unreadable)"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return f"host {holder.get('host')}, pid {holder.get('pid')}, started {started}"


def _stale(holder: dict, age: float) -> str | None:
    """Why the lock of ``holder``, last touched ``age`` seconds ago, no longer holds; None while its run may live."""
    if holder.get("host") == socket.gethostname() and holder.get("machine") == _machine():
        if isinstance(holder.get("pid"), int) and not _alive(holder["pid"], holder.get("process_start")):
            return "its process is gone"
        return None
    if age > STALE_S:
        return (
            f"not refreshed for {age / 60:.0f} minutes, longer than the {STALE_S / 60:.0f} a live run on another "
            f"host allows"
        )
    return None


def _read(lock: Path) -> tuple[str, dict, float] | None:
    """The lock's text, its holder and its age in seconds; None when there is no lock (any more)."""
    try:
        text, age = lock.read_text(), time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return None
    try:
        holder = json.loads(text)
    except json.JSONDecodeError:
        holder = {}
    return text, holder if isinstance(holder, dict) else {}, age


def _create(lock: Path, text: str) -> bool:
    """Create ``lock`` holding ``text`` unless it exists, never visible half written: a hard link to a file written
    whole (O_EXCL on a file system without hard links)."""
    tmp = lock.with_name(f".{lock.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    tmp.write_text(text)
    try:
        os.link(tmp, lock)
        return True
    except FileExistsError:
        return False
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
        try:
            with open(lock, "x") as f:
                f.write(text)
            return True
        except FileExistsError:
            return False
    finally:
        tmp.unlink(missing_ok=True)


def _discard(lock: Path, seen: str) -> None:
    """Remove the stale lock whose text was ``seen``; one another run took over meanwhile is put back."""
    trash = lock.with_name(f".{lock.name}.stale-{os.getpid()}")
    try:
        os.rename(lock, trash)
    except FileNotFoundError:
        return
    if trash.read_text() != seen and not lock.exists():
        os.rename(trash, lock)
    trash.unlink(missing_ok=True)


def _take(lock: Path, record: dict, say: Callable[[str], Any], folder: str) -> None:
    """Create the lock, taking a stale one over (said); a live holder's is refused naming it."""
    text = json.dumps(record)
    for _ in range(5):  # (a lock that vanishes or appears between looks is looked at again)
        if _create(lock, text):
            return
        if (found := _read(lock)) is None:
            continue
        seen, holder, age = found
        why = _stale(holder, age)
        if why is None:
            raise RunFolderBusy(
                f"trainer.output_dir={folder} is in use by another run ({_describe(holder)}): wait for "
                f"it to end or stop it, or give this run another trainer.output_dir"
            )
        _discard(lock, seen)
        say(
            f"note: trainer.output_dir={folder} was held by a run that is gone ({_describe(holder)}; {why}): this run "
            f"takes it over"
        )
    raise RunFolderBusy(
        f"trainer.output_dir={folder}: its lock ({lock}) keeps changing hands; is another run starting there?"
    )


def _refresh(lock: Path, stop: threading.Event) -> None:
    """Touch the lock every REFRESH_S seconds until ``stop``: a run on another host sees that this one lives."""
    while not stop.wait(REFRESH_S):
        with contextlib.suppress(OSError):
            os.utime(lock)


@contextlib.contextmanager
def hold_run_folder(
    run_dir: str | os.PathLike, *, holder: bool = True, job: str | None = None, say: Callable[[str], Any] = print
) -> Iterator[str | None]:
    """Hold ``run_dir`` (``trainer.output_dir``, made if missing) for the run inside the ``with``; yields the token
    that the job's other processes are given to recognise the lock by. ``holder``: whether this process takes it
    (rank 0 of a job; the other ranks do nothing). ``job``: the token of the lock the job's driver holds (a Ray
    worker's rank 0 checks it is that one, and takes nothing)."""
    run_dir = Path(run_dir)
    lock = run_dir / LOCK_FILE
    if not holder:
        yield job
        return
    if job is not None:
        found = _read(lock)
        if found is not None and found[1].get("token") != job:
            raise RunFolderBusy(
                f"trainer.output_dir={run_dir} is in use by another run ({_describe(found[1])}), not "
                f"this job's driver: give this run another trainer.output_dir"
            )
        yield job
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    record = _this_run(uuid.uuid4().hex)
    _take(lock, record, say, str(run_dir))
    stop = threading.Event()
    refresher = threading.Thread(target=_refresh, args=(lock, stop), name="longqa-run-lock", daemon=True)
    refresher.start()
    try:
        yield record["token"]
    finally:
        stop.set()
        found = _read(lock)
        if found is not None and found[1].get("token") == record["token"]:
            lock.unlink(missing_ok=True)
