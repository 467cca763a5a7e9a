"""The tying study: its design (:mod:`~lmhead.studies.tying.study`) and its
report (:mod:`~lmhead.studies.tying.report`); its sweep file is
``configs/sweeps/tying_study.py``."""
