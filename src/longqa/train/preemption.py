"""Preemption: SIGTERM (or SIGINT) ends training with a checkpoint of the last finished step, not with nothing.

A cluster stops a job with SIGTERM and, a grace period later, SIGKILL. Dying at once would lose every
step since the last periodic checkpoint, so the first signal is only noted (the handler sets a flag and
interrupts nothing) and the trainer acts on it at the next of two points:

* at the start of a step: it saves the last finished step, unless that checkpoint is on disk already,
  and stops;
* before a step's update, when the step's samples are drawn but no weight has moved yet: it finishes
  the step (update, validation when due, checkpoint) if that is expected to end within
  ``trainer.preemption_grace_s`` of the signal, going by this process's previous update, validation
  and save; otherwise it drops the step's samples and saves the last finished step, whose weights are
  still the ones in memory.

Sampling, updates and validations always run to their end: an update stopped halfway leaves weights and
optimizer state of no step, and sampling holds no state worth the risk of stopping code at an arbitrary line.
The first signal is said at once on stderr, with what happens next, since what is in flight (a validation,
say) may take a while yet and a silent wait reads as a hang.
When what is left of them outlasts the grace period, SIGKILL comes first and the run resumes from the
last periodic checkpoint, as after any crash. A second signal ends the process at once, as if none
were caught, unless it comes within ``ECHO_S`` of the first: that is the same stop delivered twice,
as when Slurm signals every process of the job and torchrun passes its own signal on to its ranks.

Under several ranks the request is combined at both points by a max all_reduce of three numbers
(requested, seconds since the signal, seconds the step needs to finish), so every rank, signalled
or not, stops after the same step and writes its part of the same sharded checkpoint. The ranks wait
for each other there anyway (an update begins with FSDP all-gathers; a step ends with the metrics
gather and, when due, validation and a checkpoint), and what the step made is on the host by then
(token ids, rewards, metrics), so the collective waits on no GPU work in flight.

The process then exits with status 75, ``EX_TEMPFAIL`` of sysexits.h ("temporary failure; retry"):
not 0, since a scheduler that sees success does not requeue a run that still has steps to go, and
neither 1 (a crash) nor 2 (bad input). Rerunning the same command resumes from the checkpoint. Under
torchrun the scheduler sees the launcher's status instead, which is non-zero when its ranks exit 75.

Ray Train workers train in a thread, where no signal handler can be installed: there the ``longqa
train`` driver takes the signal and asks the workers to stop through a request file in the run folder
(:func:`forward_stop_requests`), which they read at the same two points; rank 0 answers with the step
and checkpoint in a file beside it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from longqa.distributed.env import all_reduce

__all__ = ["EXIT_PREEMPTED", "ForwardedStop", "StopRequest", "forward_stop_requests", "preempted_message"]

EXIT_PREEMPTED = 75
SIGNALS = (signal.SIGTERM, signal.SIGINT)
ECHO_S = 5.0  # a signal this soon after the first repeats it; torchrun passes its own on within a second


def _install(handler) -> dict:
    """Put ``handler`` on SIGTERM and SIGINT from the main thread; the handlers it replaced, to restore.

    A signal the process was started to ignore (``nohup``, a shell's background job) stays ignored.
    Elsewhere Python refuses to install a handler, so nothing is installed.
    """
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {}
    for signum in SIGNALS:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            previous[signum] = signal.signal(signum, handler)
    return previous


def _restore(previous: dict) -> None:
    """Put back what :func:`_install` replaced (a handler set outside Python comes back as the default)."""
    for signum, handler in previous.items():
        signal.signal(signum, signal.SIG_DFL if handler is None else handler)


def _die_of(signum: int) -> None:
    """The second signal: end as an uncaught one would, at once (status 128 + signum)."""
    signal.signal(signum, signal.SIG_DFL)
    signal.raise_signal(signum)


def _say_stopping(signum: int) -> None:
    """Say that the stop asked for by ``signum`` is under way, from one process of a job (RANK 0, or none set:
    torchrun's ranks get the signal alike). Written to the stderr descriptor itself: a handler runs between two
    lines of whatever it interrupted, which may be in the middle of writing to the buffered ``sys.stderr``."""
    if os.environ.get("RANK", "0") != "0":
        return
    line = (
        f"longqa: {signal.Signals(signum).name}: stopping once the sampling, update or validation in flight "
        f"ends; the last finished step is then saved and the run exits {EXIT_PREEMPTED} (another signal, "
        f"{ECHO_S:g} s or more after this one, ends it at once)\n"
    )
    os.write(2, ("\n" if os.isatty(1) else "").encode() + line.encode())  # (past a console line left open)


def _request_time(first: float | None, signum: int) -> float:
    """When the stop was asked for: at this signal, or at the first one, which this one echoes if it
    comes within ``ECHO_S``; a later one is a second request, which ends the process now."""
    now = time.time()
    if first is not None and now - first >= ECHO_S:
        _die_of(signum)
    return now if first is None else first


def _answer_file(request_file: Path) -> Path:
    return request_file.with_name(request_file.name + ".stopped")


def _read_request(path: Path) -> float | None:
    """When the driver's request file says the stop was asked for; None while there is none."""
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    try:
        return float(text)
    except ValueError:  # caught while being written: asked for just now
        return time.time()


class StopRequest:
    """A stop asked for by SIGTERM/SIGINT (or by the driver's request file), for the trainer to act on.

    A context manager: the handlers are installed on entry and the previous ones restored on exit.
    """

    def __init__(self, request_file: str | Path | None = None):
        self.request_file = Path(request_file) if request_file else None
        self.received_at: float | None = None  # wall-clock time of the request, comparable across nodes
        self._previous: dict = {}

    def __enter__(self) -> StopRequest:
        self._previous = _install(self._note)
        return self

    def __exit__(self, *exc_info) -> None:
        _restore(self._previous)
        self._previous = {}

    def _note(self, signum: int, frame) -> None:
        """Only note the time (and say so, the first time): the trainer stops at a point where stopping is safe."""
        if self.received_at is None:
            _say_stopping(signum)
        self.received_at = _request_time(self.received_at, signum)

    def waited(self) -> float | None:
        """Seconds since a stop was asked for here, or None when it was not."""
        if self.received_at is None and self.request_file is not None:
            self.received_at = _read_request(self.request_file)
        return None if self.received_at is None else max(0.0, time.time() - self.received_at)

    def poll(self, finish_s: float, device: torch.device) -> tuple[bool, float, float]:
        """(a stop is asked for on some rank, the most seconds since, the most seconds ``finish_s``).

        Every rank must call it at the same points: under several ranks it is one collective.
        """
        waited = self.waited()
        asked, most_waited, most_finish = all_reduce(
            [float(waited is not None), waited or 0.0, finish_s], "max", device
        )
        return asked > 0, most_waited, most_finish

    def answer(self, step: int, checkpoint: str | None) -> None:
        """Tell a driver that asked through the request file where the run stopped (rank 0 only)."""
        if self.request_file is not None:
            _answer_file(self.request_file).write_text(json.dumps({"step": step, "checkpoint": checkpoint}))


class ForwardedStop:
    """The driver's side of a stop passed on to Ray Train workers (see :func:`forward_stop_requests`)."""

    def __init__(self, request_file: Path):
        self.request_file = request_file
        self.received_at: float | None = None

    def _note(self, signum: int, frame) -> None:
        """Note the time and write it for the workers: the driver's main thread spends the whole run
        blocked in ``fit()``, so no other code of ours runs to pass the request on. Blocked there, in Ray's
        ``get``, it runs this handler only when Ray checks for signals, about once a second, so the grace
        period is counted from up to a second after the signal."""
        if self.received_at is None:
            _say_stopping(signum)
        self.received_at = _request_time(self.received_at, signum)
        self.request_file.write_text(f"{self.received_at}\n")

    def stopped(self) -> dict | None:
        """``{"step", "checkpoint"}`` where the workers stopped on the request; None if they did not
        (no signal came, or it came after the last step)."""
        try:
            return json.loads(_answer_file(self.request_file).read_text())
        except FileNotFoundError:
            return None


@contextlib.contextmanager
def forward_stop_requests(request_file: str | Path) -> Iterator[ForwardedStop]:
    """In the driver of Ray Train workers: on SIGTERM/SIGINT write ``request_file`` (with the time, for
    the grace period), which the workers read; read :meth:`ForwardedStop.stopped` before leaving. Both
    files are gone afterwards."""
    forwarded = ForwardedStop(Path(request_file))
    for path in (forwarded.request_file, _answer_file(forwarded.request_file)):
        path.unlink(missing_ok=True)
    previous = _install(forwarded._note)
    try:
        yield forwarded
    finally:
        _restore(previous)
        for path in (forwarded.request_file, _answer_file(forwarded.request_file)):
            path.unlink(missing_ok=True)


def preempted_message(step: int, checkpoint: str | Path | None) -> str:
    """The one line a preempted run prints."""
    if checkpoint is None:
        return f"preempted at step {step}: no step finished, nothing to save; rerun the same command to start again"
    return f"preempted at step {step}: saved checkpoint {checkpoint}; rerun the same command to resume"
