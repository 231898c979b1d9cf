"""Training: the GRPO loop (``trainer``), its algorithm (``algo``), the policy and its micro-batches (``actor``,
``batching``), checkpoints that resume exactly (``checkpoint``, ``resume``, ``checkpoint_space``), stops on a
signal (``preemption``), metrics and the report (``report``), Ray Train workers (``ray_launcher``) and the
supervised warm-up (``sft``)."""
