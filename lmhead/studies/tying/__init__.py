"""The tying study: its design (:mod:`~lmhead.studies.tying.study`, with the
arms' matched shapes in :mod:`~lmhead.studies.tying.shapes`) and its report
(:mod:`~lmhead.studies.tying.report`, on the runs read back by
:mod:`~lmhead.studies.tying.results`, against published results in
:mod:`~lmhead.studies.tying.literature`); its sweep file is
``configs/sweeps/tying_study.py``."""
