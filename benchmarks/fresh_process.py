"""One measurement case in a fresh Python process, for the benchmarks that take a process's peak memory.

Each case starts from the same empty process, so one case's freed memory cannot hide in the next one's peak. glibc
is told to map every block of 64 KiB or more on its own (``MALLOC_MMAP_THRESHOLD_``), so a freed tensor leaves the
resident set instead of staying in the heap, and ``resource.getrusage``'s ``ru_maxrss`` over a pass is the pass's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


def case_in_fresh_process(script: str, arguments: list[str]) -> dict:
    """Run ``script`` with ``arguments`` in a fresh Python process; the JSON object its last line of output prints."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}
    command = [sys.executable, script, *arguments]
    out = subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])
