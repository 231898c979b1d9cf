"""Models and tokenizers: loading (``load``), the packed layout and its attention (``packing``, ``attention``),
log-probs (``logprobs``), activation offload (``offload``), and what ``torch.compile`` builds and keeps
(``compile_cache``, ``compile_watch``)."""
