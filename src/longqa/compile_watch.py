"""What a warm run compiled or captured again, and why.

Once a run is warm a GRPO step should build nothing: the update is compiled for every packed length before the
first step, and the fast engine captures its decode step once per (prompt view, response view) bucket. A step
that compiles again costs seconds (and past Dynamo's recompile limit falls back to eager kernels); one that
captures again costs a few decode steps. ``perf/recompiles`` and ``perf/graph_captures`` count them; what to
change depends on why they happened, which is what this keeps: Dynamo's own reason for each recompilation (the
function, and the guard that failed: a tensor whose size changed, a Python value) and the engine's account of
each capture (the bucket) and of each time it re-sized its KV stores (which drops every captured graph).
"""

from __future__ import annotations

import os


def _guard_failures() -> dict:
    """Dynamo's record: for each compiled code object, the guards that failed each time it was compiled again
    (one entry per cached graph that no longer matched)."""
    from torch._dynamo.utils import guard_failures

    return guard_failures


def _where(code) -> str:
    return f"{code.co_name} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"


class CompileWatch:
    """``news()``: what was compiled or captured again since the watch began or ``news()`` last ran, as lines
    such as ``"recompiled forward (modeling_llama.py:280): tensor 'x' size mismatch at index 1. expected 5888,
    actual 11776"`` or ``"captured the decode step for prompt view 7936, response view 192 (64 groups)"``.
    ``engine``: a rollout engine whose ``graph_events`` (if it has them) are followed too."""

    def __init__(self, engine=None):
        self.engine = engine
        self._seen = self._counts()
        self._events = len(self._engine_events())

    def _engine_events(self) -> list[str]:
        return getattr(self.engine, "graph_events", [])

    @staticmethod
    def _counts() -> dict:
        return {code: len(reasons) for code, reasons in _guard_failures().items()}

    def news(self) -> list[str]:
        lines = []
        for code, reasons in list(_guard_failures().items()):
            for reason in dict.fromkeys(reasons[self._seen.get(code, 0):]):  # (each distinct reason once)
                lines.append(f"recompiled {_where(code)}: {reason}")
        events = self._engine_events()
        lines += events[self._events:]
        self._seen, self._events = self._counts(), len(events)
        return lines
