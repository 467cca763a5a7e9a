"""Sweep tooling: grids of runs and reading them back
(:mod:`~lmhead.lab.sweeps`), and statistics over seeds
(:mod:`~lmhead.lab.stats`)."""
