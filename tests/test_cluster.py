"""Hostfile parsing and the exact commands `longqa cluster` runs, without contacting any host."""

import shlex

import pytest

from longqa.cli import main
from longqa.distributed.cluster import (
    Host,
    HostfileError,
    Step,
    down_commands,
    parse_hostfile,
    run_steps,
    status_command,
    up_commands,
)

SSH = ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=accept-new"]


def write(tmp_path, text):
    path = tmp_path / "hostfile"
    path.write_text(text)
    return path


def test_hostfile_with_comments_and_blank_lines(tmp_path):
    path = write(
        tmp_path,
        "# the recipe's 4 nodes\n\n10.0.0.1 slots=8\n  10.0.0.2   slots=8   # rack 2\n"
        "10.0.0.3 slots = 4\nnode-4.cluster slots=2\n",
    )
    assert parse_hostfile(path) == [
        Host("10.0.0.1", 8),
        Host("10.0.0.2", 8),
        Host("10.0.0.3", 4),
        Host("node-4.cluster", 2),
    ]


@pytest.mark.parametrize(
    "text,message",
    [
        ("10.0.0.1 slots=8\n10.0.0.2\n", "line 2: 10.0.0.2 has no slots=N"),
        ("10.0.0.1 slots=0\n", "line 1: slots must be a positive integer"),
        ("10.0.0.1 slots=8\n\n10.0.0.2 gpus=8\n", "line 3: expected 'IP slots=N'"),
        ("10.0.0.1 slots=8\n10.0.0.1 slots=8\n", "line 2: host 10.0.0.1 is listed twice"),
        ("10.0.0.1; slots=8\n", "line 1: '10.0.0.1;' is not an IP address or host name"),
        ("# nothing\n\n", "lists no hosts"),
    ],
)
def test_bad_lines_are_rejected_with_their_numbers(tmp_path, text, message):
    with pytest.raises(HostfileError, match=message):
        parse_hostfile(write(tmp_path, text))


def test_every_bad_line_is_reported_at_once(tmp_path):
    with pytest.raises(HostfileError) as e:
        parse_hostfile(write(tmp_path, "x y z\n10.0.0.1 slots=8\n10.0.0.2 slots=-1\n"))
    assert "line 1" in str(e.value) and "line 3" in str(e.value)


def test_up_stops_everywhere_then_starts_head_and_workers():
    hosts = [Host("10.0.0.1", 8), Host("10.0.0.2", 4)]
    steps = up_commands(hosts, port=6380, local_head=False)
    assert steps == [
        Step([*SSH, "10.0.0.1", "ray stop --force"], may_fail=True),
        Step([*SSH, "10.0.0.2", "ray stop --force"], may_fail=True),
        Step(
            [
                *SSH,
                "10.0.0.1",
                "ray start --head --node-ip-address=10.0.0.1 --port=6380 --num-gpus=8 "
                "--dashboard-host=0.0.0.0 --dashboard-port=8265",
            ]
        ),
        Step([*SSH, "10.0.0.2", "ray start --address=10.0.0.1:6380 --node-ip-address=10.0.0.2 --num-gpus=4"]),
    ]
    local = up_commands(hosts, local_head=True)
    assert local[0] == Step(["ray", "stop", "--force"], may_fail=True)  # the head is this machine: no ssh
    assert local[2].argv[:3] == ["ray", "start", "--head"] and local[3].argv[: len(SSH)] == SSH


def test_down_stops_workers_then_the_head_and_status_asks_the_head():
    hosts = [Host("10.0.0.1", 8), Host("10.0.0.2", 8), Host("10.0.0.3", 8)]
    assert [s.argv[len(SSH)] for s in down_commands(hosts, local_head=False)] == ["10.0.0.2", "10.0.0.3", "10.0.0.1"]
    assert all(s.may_fail for s in down_commands(hosts, local_head=False))
    assert status_command(hosts) == [Step(["ray", "status", "--address=10.0.0.1:6379"])]


def test_run_steps_stops_at_a_real_failure_only(tmp_path, capsys):
    marker = tmp_path / "ran"
    run_steps([Step(["false"], may_fail=True), Step(["touch", str(marker)])])
    assert marker.exists()
    with pytest.raises(HostfileError, match="exit status 1: false"):
        run_steps([Step(["false"]), Step(["touch", str(tmp_path / "never")])])
    assert not (tmp_path / "never").exists()
    with pytest.raises(HostfileError, match="is it installed"):
        run_steps([Step(["longqa-no-such-program"])])


def test_cli_dry_run_prints_the_commands_and_how_to_connect(tmp_path, capsys):
    """--dry-run prints the commands, says that none of them ran and started nothing, then what they would
    start and how to reach it."""
    path = write(tmp_path, "10.9.0.1 slots=8\n10.9.0.2 slots=8\n")
    assert main(["cluster", "up", "--hostfile", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "10.9.0.2 'ray start --address=10.9.0.1:6379" in out and "RAY_ADDRESS=10.9.0.1:6379" in out
    assert out.splitlines()[-3:] == [
        "dry run: none of these commands was run",
        "nothing was started; without --dry-run they start a Ray cluster of 2 host(s), 16 GPU slot(s): head "
        "10.9.0.1:6379, dashboard http://10.9.0.1:8265",
        f"  then connect with RAY_ADDRESS=10.9.0.1:6379; stop it with: longqa cluster down --hostfile {path}",
    ]
    assert main(["cluster", "down", "--hostfile", str(path), "--dry-run"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "dry run: none of these commands was run"
    bad = write(tmp_path, "10.9.0.1 slots=eight\n")
    assert main(["cluster", "up", "--hostfile", str(bad), "--dry-run"]) == 2
    assert "line 1" in capsys.readouterr().err


def test_an_ipv6_head_is_bracketed_where_a_port_follows(tmp_path, capsys):
    hosts = [Host("fe80::1", 8), Host("10.0.0.2", 8)]
    worker = up_commands(hosts, port=6380, local_head=False)[-1]
    assert shlex.split(worker.argv[-1])[:4] == [
        "ray",
        "start",
        "--address=[fe80::1]:6380",
        "--node-ip-address=10.0.0.2",
    ]
    assert status_command(hosts)[0].argv[-1] == "--address=[fe80::1]:6379"
    path = write(tmp_path, "fe80::1 slots=8\n10.0.0.2 slots=8\n")
    assert main(["cluster", "up", "--hostfile", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "RAY_ADDRESS=[fe80::1]:6379;" in out and "dashboard http://[fe80::1]:8265" in out


def test_stopping_takes_no_port(tmp_path, capsys):
    path = write(tmp_path, "10.9.0.1 slots=8\n")
    with pytest.raises(SystemExit):
        main(["cluster", "down", "--hostfile", str(path), "--port", "6380", "--dry-run"])
    assert "unrecognized arguments: --port 6380" in capsys.readouterr().err
