"""Training: the GRPO loop and the checkpoints that let it resume exactly after a crash."""
