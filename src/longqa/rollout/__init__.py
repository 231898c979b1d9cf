"""Rollout: sampling the GRPO group of responses for each prompt, behind one engine interface (``base``): the fast
engine (``fast``, with its decode step and kernels), the plain transformers reference (``hf``), vLLM
(``vllm_engine``) and sampler ranks of their own (``remote``), the one a config names built by ``build``."""
