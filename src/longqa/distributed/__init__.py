"""Distributed runs: cluster start-up from a hostfile, memory planning."""
