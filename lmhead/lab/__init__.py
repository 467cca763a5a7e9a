"""Sweep tooling: the sweep-file API (:mod:`~lmhead.lab.sweeps`), the sweep
runner (:mod:`~lmhead.lab.runner`, run by ``experiments/sweep.py``), its runs
grouped into ensemble programs (:mod:`~lmhead.lab.ensembles`), runs read
back from their directories (:mod:`~lmhead.lab.workdirs`), statistics over
seeds (:mod:`~lmhead.lab.stats`), and the sweep report writer
(:mod:`~lmhead.lab.report`, run by ``experiments/report.py``)."""
