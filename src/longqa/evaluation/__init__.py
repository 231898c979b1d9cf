"""Evaluation: greedy answers scored per source, length and hop count (``evaluate``), and LongBench v1's multi-hop
QA sets scored by LongBench's own rules (``longbench``)."""
