"""A group slot of the fast engine's KV stores, as the host follows it between its looks at the device."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Slot:
    """What the host knows of one slot without asking the device: whose group it holds and how far that group can
    have got. The decode loop reads the device only every few steps (``FastRolloutEngine._run``); in between, these
    bounds say when a group must have finished and how wide the views of the KV stores must be.

    ``prompt`` is the index of the prompt whose group the slot holds (None while free) and ``prompt_len`` its
    length; ``age`` counts the decode steps since it was admitted, each of which adds at least one token to every
    live row; ``done_at`` is the age at which every row has reached its length limit; ``reach`` is the longest
    length its rows may have reached (set from the device at each look, then raised by the most tokens a step can
    add to a row)."""

    prompt: int | None = None
    prompt_len: int = 0
    age: int = 0
    done_at: int = 0
    reach: int = 1

    @property
    def free(self) -> bool:
        return self.prompt is None

    def admit(self, prompt: int, prompt_len: int, longest_limit: int) -> None:
        """Take prompt ``prompt``'s group, whose longest row may run to ``longest_limit`` tokens (the first of
        which comes with the prefill)."""
        self.prompt, self.prompt_len, self.age = prompt, prompt_len, 0
        self.done_at = longest_limit - 1

    def stepped(self, tokens: int) -> None:
        """One decode step ran, adding at most ``tokens`` to each of the slot's rows."""
        self.age += 1
        self.reach += tokens
