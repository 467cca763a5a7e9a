"""The tying study: its design (:mod:`~lmhead.studies.tying.study`, with the
arms' matched shapes in :mod:`~lmhead.studies.tying.shapes`), its runs read
back into ``runs.csv`` (:mod:`~lmhead.studies.tying.results`, the columns in
:mod:`~lmhead.studies.tying.table`), the report from that file alone
(:mod:`~lmhead.studies.tying.analysis`, with its sections
:mod:`~lmhead.studies.tying.answer`, :mod:`~lmhead.studies.tying.design_text`
and :mod:`~lmhead.studies.tying.tuning_text`, the numbers of
:mod:`~lmhead.studies.tying.cells` and the plots of
:mod:`~lmhead.studies.tying.contrast_plots`), against published results
(:mod:`~lmhead.studies.tying.literature`, which reads them from
``literature.toml``), and the head's diagnostics
(:mod:`~lmhead.studies.tying.diagnostics`); its sweep file is
``configs/sweeps/tying_study.py``."""
