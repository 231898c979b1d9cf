"""longqa: GRPO training for long-context multi-hop question answering."""

__version__ = "0.1.0"
