"""Peer engines for the benchmarks, each in a Python of its own (see process.py)."""
