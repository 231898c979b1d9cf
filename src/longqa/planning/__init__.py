"""Planning before any weight is read: per-GPU memory of a run (``planner``, with the activations one micro-batch
holds, ``activations``), host memory (``host_memory``), FLOPs and bandwidth floors (``flops``), a first-order
step time (``step_time``), the largest shape that fits (``fit``) and the split of GPUs between sampling and
training (``split_plan``)."""
