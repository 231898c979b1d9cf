"""Sharded training: ranks and devices (``env``), FSDP2 (``fsdp``) or DeepSpeed ZeRO-3 (``deepspeed``), gathering
sharded weights for the rollout engines (``gather``), and starting Ray over ssh (``cluster``)."""
