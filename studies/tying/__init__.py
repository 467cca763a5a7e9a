"""The tying study: its design, its runs read back into ``runs.csv``, the
report from that file alone, and the head's diagnostics; the modules are
listed in ``docs/tying_study/README.md`` ("The code")."""
