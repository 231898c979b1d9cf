"""``longqa cluster``: a Ray cluster over ssh from an MPI-style hostfile, as the reference recipe starts one.

The hostfile lists one machine per line, ``IP slots=N`` (N GPUs), with ``#`` comments and blank lines.
``up`` stops any Ray already running on every host, starts the head on the first host and a worker
on each of the others with its GPU count; ``down`` stops Ray everywhere. The commands are built as
plain argument lists first (``up_commands``/``down_commands``), so they can be shown (``--dry-run``)
and tested without contacting any host, then run one by one, stopping at the first failure.
"""

from __future__ import annotations

import ipaddress
import re
import shlex
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

RAY_PORT = 6379
DASHBOARD_PORT = 8265
SSH = ("ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=accept-new")


class HostfileError(ValueError):
    """The hostfile cannot be used; the message names the file and line."""


@dataclass(frozen=True)
class Host:
    address: str
    slots: int


@dataclass(frozen=True)
class Step:
    """One command line; ``may_fail`` for ``ray stop`` on a host where nothing runs."""

    argv: list[str]
    may_fail: bool = False


_LINE = re.compile(r"^(?P<host>\S+)(?:\s+slots\s*=\s*(?P<slots>\S+))?\s*$")


def parse_hostfile(path: str | Path) -> list[Host]:
    """Hosts in file order; every bad line is reported with its number, all at once."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise HostfileError(f"cannot read hostfile {path}: {e.strerror or e}") from e
    hosts, errors, seen = [], [], set()
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _LINE.match(line)
        if match is None:
            errors.append(f"line {number}: expected 'IP slots=N', got {raw.strip()!r}")
            continue
        address, slots = match["host"], match["slots"]
        if not _valid_host(address):
            errors.append(f"line {number}: {address!r} is not an IP address or host name")
            continue
        if slots is None:  # a bare address: the GPU count was left out, not mistyped
            errors.append(f"line {number}: {address} has no slots=N (its GPU count): write '{address} slots=N'")
            continue
        if not slots.isdigit() or int(slots) < 1:
            errors.append(f"line {number}: slots must be a positive integer (GPUs on that host), got {raw.strip()!r}")
            continue
        if address in seen:
            errors.append(f"line {number}: host {address} is listed twice")
            continue
        seen.add(address)
        hosts.append(Host(address, int(slots)))
    if errors:
        raise HostfileError(f"hostfile {path}:\n  " + "\n  ".join(errors))
    if not hosts:
        raise HostfileError(f"hostfile {path} lists no hosts")
    return hosts


def _valid_host(address: str) -> bool:
    try:
        ipaddress.ip_address(address)
        return True
    except ValueError:
        return re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?", address) is not None


def _is_local(address: str) -> bool:
    if address in ("localhost", "127.0.0.1", "::1"):
        return True
    try:
        return (
            address in (socket.gethostname(), socket.getfqdn())
            or address in socket.gethostbyname_ex(socket.gethostname())[2]
        )
    except OSError:
        return False


def endpoint(address: str, port: int) -> str:
    """``address:port``, with an IPv6 address in brackets (``[fe80::1]:6379``) so the port stays apart from it."""
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def _on(host: Host, command: list[str], local: bool) -> list[str]:
    return command if local else [*SSH, host.address, shlex.join(command)]


def _stop(host: Host, ray: str, local: bool) -> Step:
    return Step(_on(host, [ray, "stop", "--force"], local), may_fail=True)


def up_commands(
    hosts: list[Host], port: int = RAY_PORT, ray: str = "ray", local_head: bool | None = None
) -> list[Step]:
    """Stop Ray everywhere, start the head on the first host, then a worker on every other host."""
    head = hosts[0]
    local = _is_local(head.address) if local_head is None else local_head
    steps = [_stop(h, ray, local and h is head) for h in hosts]
    steps.append(
        Step(
            _on(
                head,
                [
                    ray,
                    "start",
                    "--head",
                    f"--node-ip-address={head.address}",
                    f"--port={port}",
                    f"--num-gpus={head.slots}",
                    "--dashboard-host=0.0.0.0",
                    f"--dashboard-port={DASHBOARD_PORT}",
                ],
                local,
            )
        )
    )
    for host in hosts[1:]:
        steps.append(
            Step(
                _on(
                    host,
                    [
                        ray,
                        "start",
                        f"--address={endpoint(head.address, port)}",
                        f"--node-ip-address={host.address}",
                        f"--num-gpus={host.slots}",
                    ],
                    False,
                )
            )
        )
    return steps


def down_commands(hosts: list[Host], ray: str = "ray", local_head: bool | None = None) -> list[Step]:
    """Stop Ray on the workers first, then on the head."""
    local = _is_local(hosts[0].address) if local_head is None else local_head
    return [_stop(h, ray, local and h is hosts[0]) for h in [*hosts[1:], hosts[0]]]


def status_command(hosts: list[Host], port: int = RAY_PORT, ray: str = "ray") -> list[Step]:
    return [Step([ray, "status", f"--address={endpoint(hosts[0].address, port)}"])]


def run_steps(steps: list[Step], dry_run: bool = False) -> None:
    """Run each command in turn (or only print it, and say that none ran), stopping at the first failure that
    matters."""
    for step in steps:
        print("$ " + shlex.join(step.argv), flush=True)
        if dry_run:
            continue
        try:
            code = subprocess.run(step.argv).returncode
        except FileNotFoundError as e:
            raise HostfileError(f"cannot run {step.argv[0]!r}: {e.strerror} (is it installed?)") from e
        if code and not step.may_fail:
            raise HostfileError(f"command failed with exit status {code}: {shlex.join(step.argv)}")
    if dry_run:
        print("dry run: none of these commands was run", flush=True)


def reach_message(hosts: list[Host], hostfile: str | Path, port: int = RAY_PORT, dry_run: bool = False) -> str:
    """How to reach the cluster ``up`` started; after ``--dry-run``, the cluster those commands would start."""
    head = endpoint(hosts[0].address, port)
    gpus = sum(h.slots for h in hosts)
    cluster = (
        f"Ray cluster of {len(hosts)} host(s), {gpus} GPU slot(s): head {head}, dashboard "
        f"http://{endpoint(hosts[0].address, DASHBOARD_PORT)}"
    )
    if dry_run:
        return (
            f"nothing was started; without --dry-run they start a {cluster}\n  then connect with "
            f"RAY_ADDRESS={head}; stop it with: longqa cluster down --hostfile {shlex.quote(str(hostfile))}"
        )
    return (
        f"{cluster}\n  connect with RAY_ADDRESS={head}; "
        f"stop it with: longqa cluster down --hostfile {shlex.quote(str(hostfile))}"
    )
