"""What a warm run compiled or captured again, and why.

Once a run is warm a GRPO step should build nothing: the update is compiled for every packed length before the
first step, and the fast engine captures its decode step once per sampling setting and KV store (with the
batched-matmul attention, once per (prompt view, response view)). A step
that compiles again costs seconds (and past Dynamo's recompile limit falls back to eager kernels); one that
captures again costs a few decode steps. ``perf/recompiles`` and ``perf/graph_captures`` count them; what to
change depends on why they happened, which is what this keeps: Dynamo's own reason for each recompilation (the
function, and the guard that failed: a tensor whose size changed, a Python value) and the engine's account of
each capture (the bucket) and of each time it re-sized its KV stores (which drops every captured graph).
"""

from __future__ import annotations

import os
import re


def _guard_failures() -> dict:
    """Dynamo's record: for each compiled code object, the guards that failed each time it was compiled again
    (one entry per cached graph that no longer matched)."""
    from torch._dynamo.utils import guard_failures

    return guard_failures


def _where(code) -> str:
    return f"{code.co_name} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"


def _summary(reasons: list[str]) -> str:
    """Dynamo's failed guards, one per cached graph that did not match, grouped: a function compiled for 16 lengths
    in two modes fails 32 guards, mostly "another size" or "another grad mode"; the rarest kind is usually the one
    to read (here, the graph of this very size had been built in evaluation mode), so it comes first."""
    kinds: dict[str, list[str]] = {}
    for reason in reasons:
        guard = " ".join(reason.split("\n", 1)[0].split())  # the guard, without Dynamo's user stack
        guard = re.sub(r"^\d+/\d+: ", "", guard)  # which cached graph it was
        kinds.setdefault(re.sub(r"expected \S+, actual", "actual", guard), []).append(guard)
    return "; ".join(
        guards[0] if len(guards) == 1 else f"{kind} ({len(guards)} cached graphs)"
        for kind, guards in sorted(kinds.items(), key=lambda item: len(item[1]))
    )


class CompileWatch:
    """``news()``: what was compiled or captured again since the watch began or ``news()`` last ran, as lines
    such as ``"recompiled forward (modeling_llama.py:280): tensor 'x' size mismatch at index 1. expected 5888,
    actual 11776"`` (a line per function, its failed guards grouped by ``_summary``) or ``"captured the decode
    step for prompt view 7936, response view 192 (64 groups of 8) in 0.41 s"``. ``engine``: a rollout engine whose
    ``graph_events`` (``RolloutEngine``: none for an engine that captures no graphs) are followed too."""

    def __init__(self, engine=None):
        self.engine = engine
        self._seen = self._counts()
        self._events = len(self._engine_events())

    def _engine_events(self):
        return self.engine.graph_events if self.engine is not None else ()

    @staticmethod
    def _counts() -> dict:
        return {code: len(reasons) for code, reasons in _guard_failures().items()}

    def news(self, engine_events: bool = True) -> list[str]:
        """The lines since the last call; ``engine_events=False`` leaves the engine's out (they are still
        consumed): those that followed a request of another shape, which re-sizes the KV stores by design."""
        lines = [
            f"recompiled {_where(code)}: {_summary(reasons[self._seen.get(code, 0) :])}"
            for code, reasons in list(_guard_failures().items())
            if len(reasons) > self._seen.get(code, 0)
        ]
        events = self._engine_events()
        if engine_events:
            lines += events[self._events :]
        self._seen, self._events = self._counts(), len(events)
        return lines
