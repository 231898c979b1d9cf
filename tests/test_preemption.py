"""The stop request behind preemption: signals noted, not obeyed, until the trainer asks; whole runs are in
test_train.py (one process) and test_distributed.py (torchrun, Ray)."""

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from longqa.train.preemption import StopRequest, forward_stop_requests

ROOT = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")


@pytest.fixture
def handlers():
    """The SIGTERM and SIGINT handlers before the test, put back after it whatever it did."""
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield before
    for signum, handler in before.items():
        signal.signal(signum, handler)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_is_noted_and_the_handlers_come_back(handlers, signum):
    # Python's own handler, as in a terminal: a suite started in the background by a script inherits SIGINT
    # ignored, which a stop request leaves alone (the next test).
    signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
    own = {s: signal.getsignal(s) for s in handlers}
    with StopRequest() as request:
        assert request.waited() is None and request.poll(5.0, CPU) == (False, 0.0, 5.0)
        signal.raise_signal(signum)  # noted; nothing is interrupted
        asked, waited, finish = request.poll(5.0, CPU)
        assert asked and 0 <= waited < 60 and finish == 5.0
    assert {s: signal.getsignal(s) for s in handlers} == own


def test_the_first_signal_is_said_at_once_by_one_rank_and_its_echo_is_not(handlers, capfd, monkeypatch):
    """What is in flight may take a while yet (a validation): the stop is said when it is asked for, by the one
    process of a job that speaks (RANK 0, or none set), and once."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for rank, said in ((None, True), ("0", True), ("1", False)):
        if rank is None:
            monkeypatch.delenv("RANK", raising=False)
        else:
            monkeypatch.setenv("RANK", rank)
        with StopRequest():
            signal.raise_signal(signal.SIGINT)
            first = capfd.readouterr().err
            signal.raise_signal(signal.SIGINT)  # an echo of the same request
            assert capfd.readouterr().err == ""
        assert first.strip() == (
            "longqa: SIGINT: stopping once the sampling, update or validation in flight ends; "
            "the last finished step is then saved and the run exits 75 (another signal, 5 s "
            "or more after this one, ends it at once)"
            if said
            else ""
        )


def test_a_signal_the_process_ignores_stays_ignored(handlers):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as under nohup, or in a shell's background job
    with StopRequest() as request:
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        signal.raise_signal(signal.SIGINT)
        assert request.waited() is None
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_outside_the_main_thread_nothing_is_installed(handlers):
    """Where Ray Train runs the training function: Python allows no handler there."""
    seen = []

    def enter():
        with StopRequest() as request:
            seen.append((request.waited(), signal.getsignal(signal.SIGTERM)))

    thread = threading.Thread(target=enter)
    thread.start()
    thread.join()
    assert seen == [(None, handlers[signal.SIGTERM])]


def test_a_second_signal_ends_the_process_at_once_and_an_echo_does_not():
    """An echo (Slurm signals every process, torchrun passes its own on) comes within ECHO_S and is the
    same request; a signal after that is a second one."""
    code = (
        "import signal, time\nfrom longqa.train import preemption\npreemption.ECHO_S = 0.5\n"
        "with preemption.StopRequest():\n"
        "    signal.raise_signal(signal.SIGTERM)\n    signal.raise_signal(signal.SIGTERM)\n"
        "    print('noted', flush=True)\n    time.sleep(0.6)\n"
        "    signal.raise_signal(signal.SIGTERM)\n    time.sleep(30)\n    print('still running')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert done.stdout == "noted\n" and done.returncode == -signal.SIGTERM, done.stderr


def test_a_driver_passes_the_stop_on_and_hears_where_it_ended(handlers, tmp_path):
    """forward_stop_requests (the Ray driver) writes the request for the workers' StopRequest to read;
    rank 0's answer comes back; both files are gone after."""
    path = tmp_path / ".stop-request"
    path.write_text("left by a driver that was killed\n")
    with forward_stop_requests(path) as forwarded:
        worker = StopRequest(path)
        assert worker.waited() is None and forwarded.stopped() is None  # the stale file went first
        signal.raise_signal(signal.SIGTERM)
        assert forwarded.received_at is not None and 0 <= worker.waited() < 60
        worker.answer(3, "/runs/x/checkpoints/step_00000003")
        assert forwarded.stopped() == {"step": 3, "checkpoint": "/runs/x/checkpoints/step_00000003"}
    assert not list(tmp_path.iterdir())
    assert {s: signal.getsignal(s) for s in handlers} == handlers
