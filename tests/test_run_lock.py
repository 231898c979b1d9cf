"""A run folder is held by one run at a time: a live holder refuses others, a stale lock is taken over and said,
and the processes of one job share the lock."""

import os
import socket
import time

import pytest

from longqa.outputs.lock import LOCK_FILE, STALE_S, RunFolderBusy, hold_run_folder


def test_a_lock_from_another_host_holds_until_it_goes_unrefreshed_for_the_stated_time(tmp_path, monkeypatch):
    """Another host's processes cannot be looked at: its lock holds while it is refreshed, and is taken over (said)
    once it has not been for STALE_S seconds."""
    run = tmp_path / "run"
    here = socket.gethostname()
    monkeypatch.setattr(socket, "gethostname", lambda: "node-7")
    elsewhere = hold_run_folder(run)
    elsewhere.__enter__()  # a run on node-7, never ended (its node was lost)
    monkeypatch.setattr(socket, "gethostname", lambda: here)
    try:
        with pytest.raises(
            RunFolderBusy,
            match=rf"trainer.output_dir={run} is in use by another run \(host node-7, "
            rf"pid {os.getpid()}, started ",
        ):
            with hold_run_folder(run):
                pass
        old = time.time() - STALE_S - 60
        os.utime(run / LOCK_FILE, (old, old))
        said = []
        with hold_run_folder(run, say=said.append):
            assert (run / LOCK_FILE).is_file()
        assert len(said) == 1 and said[0].startswith(
            f"note: trainer.output_dir={run} was held by a run that is gone (host node-7, pid {os.getpid()}, started "
        )
        assert said[0].endswith(
            "; not refreshed for 11 minutes, longer than the 10 a live run on another host "
            "allows): this run takes it over"
        )
        assert not (run / LOCK_FILE).exists()  # given back at the end
    finally:
        elsewhere.__exit__(None, None, None)  # (the lock is no longer its own: it removes nothing)


def test_the_processes_of_one_job_share_the_lock(tmp_path):
    """torchrun's other ranks take nothing; a Ray worker given its driver's token recognises the driver's lock,
    and one given another token is refused."""
    run = tmp_path / "run"
    with hold_run_folder(run) as token:
        with hold_run_folder(run, holder=False):
            pass
        with hold_run_folder(run, job=token):
            pass
        assert (run / LOCK_FILE).is_file()
        with pytest.raises(RunFolderBusy, match="is in use by another run .*, not this job's driver"):
            with hold_run_folder(run, job="another"):
                pass
    assert not (run / LOCK_FILE).exists()
