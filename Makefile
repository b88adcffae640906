# The course's commands. Start here:
#   make course   create .venv if needed, then execute every course notebook and lab solution
#   make test     create .venv if needed, then run the test suite (what CI runs)
#   make lab      open JupyterLab on the course
#   make release  regenerate labs/ from solutions/
# Parameters of `make course`: WORLD (ranks, 2), BACKEND (auto|gloo|nccl), SCALE (small|large),
# ONLY (run notebooks whose path contains this), JOBS (notebooks at once, 1),
# e.g. `make course WORLD=4 BACKEND=nccl`.

SHELL   := /bin/bash
PYTHON  ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed-from-pyproject
WORLD   ?= 2
BACKEND ?= auto
SCALE   ?= small
ONLY    ?=
JOBS    ?= 1
PYTEST_ARGS ?=
# pytest-xdist workers of `make test`; 0 (the default) runs the suite in one process.
# tests/conftest.py says how workers share it. On 2 cores, 2 workers took 1781 s against 2006 s
# in one process (the machine is then saturated: 1.76 busy cores of 2, against 1.07) and in
# each of two runs one browser test failed under that load; so one process stays the default
# there, and TEST_WORKERS=2 is for machines with cores to spare.
TEST_WORKERS ?= 0
LAB_ARGS ?=

# nbgrader runs `alembic`, jupyter runs its helpers: the environment's bin/ comes first.
export PATH := $(abspath $(BIN)):$(PATH)
export PYTHONUNBUFFERED := 1

.PHONY: setup course test lab release clean

setup: $(STAMP)

# The environment is rebuilt only when pyproject.toml (the single dependency list) changes;
# a half-made one (no working pip) is made again from scratch.
# Each step prints one line when it starts and one when it ends, with its time: the install is
# the long one (3-8 minutes on a fresh machine, most of it torch; seconds with pip's cache warm).
$(STAMP): pyproject.toml
	@if ! $(BIN)/python -m pip --version >/dev/null 2>&1; then \
	  echo "setup 1/3: creating $(VENV) with $$($(PYTHON) --version)"; rm -rf $(VENV); \
	  $(PYTHON) -m venv $(VENV) || { echo "could not create $(VENV)" >&2; rm -rf $(VENV); exit 1; }; \
	fi
	@echo "setup 2/3: pip installs the course and its dependencies into $(VENV) (torch, jupyterlab, nbgrader, ...): 3-8 min the first time; one line per package as pip collects it"
	@start=$$(date +%s); \
	  $(BIN)/python -m pip install --progress-bar off -e ".[test,instructor]" 2>&1 \
	    | grep --line-buffered -E '^(Collecting|Successfully installed|ERROR|error)' \
	    | sed -u -e 's/^Successfully installed .*/  pip: installed/' -e 's/^Collecting \([^ ;]*\).*/  pip: \1/'; \
	  status=$${PIPESTATUS[0]}; \
	  if [ $$status -ne 0 ]; then echo "setup: pip install failed (exit $$status); run it again to see pip's full output: $(BIN)/python -m pip install -e '.[test,instructor]'" >&2; exit $$status; fi; \
	  echo "setup 2/3: done in $$(( $$(date +%s) - start )) s"
	@# jsonschema imports rfc3987-syntax, when installed, to check the `iri` format, and that
	@# module compiles 38 Lark grammars at import: 1 s of every process that imports nbformat
	@# (each grader, papermill run, Jupyter server; 4-10 s on a busy 2-core machine). No notebook
	@# or Jupyter schema uses `iri`; without the module jsonschema leaves that one format
	@# unchecked (jsonschema/_format.py, `with suppress(ImportError)`; upstream issue #1428).
	@$(BIN)/python -m pip uninstall -y -q rfc3987-syntax 2>/dev/null || true
	@echo "setup 3/3: registering the Jupyter kernel 'labkit'"
	@$(BIN)/python -m ipykernel install --sys-prefix --name labkit --display-name "Python (labkit)" >/dev/null
	@touch $@

course: $(STAMP)
	$(BIN)/labkit build --world $(WORLD) --backend $(BACKEND) --scale $(SCALE) --jobs $(JOBS) $(if $(ONLY),--only $(ONLY))

test: $(STAMP)
	@if [ -x .ci/install-browser ]; then .ci/install-browser; fi
	@if [ -x .ci/install-postgres ]; then .ci/install-postgres; fi
	@$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadscope $(PYTEST_ARGS); status=$$?; \
	  if [ $$status -eq 5 ]; then echo "make test: pytest collected no tests: that is a failure" >&2; fi; \
	  exit $$status

lab: $(STAMP)
	$(BIN)/jupyter lab --ServerApp.root_dir=. $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS)

release: $(STAMP)
	$(BIN)/labkit release

clean:
	rm -rf build grading .pytest_cache .hypothesis
