"""Models and tokenizers."""
