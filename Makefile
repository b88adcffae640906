# The course's commands. Start here:
#   make course   create .venv if needed, then execute every course notebook and lab solution
#   make test     create .venv if needed, then run the test suite (what CI runs)
#   make lab      open JupyterLab on the course
#   make release  regenerate labs/ from solutions/
# Parameters of `make course`: WORLD (ranks, 2), BACKEND (auto|gloo|nccl), SCALE (small|large),
# ONLY (run notebooks whose path contains this), e.g. `make course WORLD=4 BACKEND=nccl`.

PYTHON  ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed-from-pyproject
WORLD   ?= 2
BACKEND ?= auto
SCALE   ?= small
ONLY    ?=
PYTEST_ARGS ?=
LAB_ARGS ?=

# nbgrader runs `alembic`, jupyter runs its helpers: the environment's bin/ comes first.
export PATH := $(abspath $(BIN)):$(PATH)
export PYTHONUNBUFFERED := 1

.PHONY: setup course test lab release clean

setup: $(STAMP)

# The environment is rebuilt only when pyproject.toml (the single dependency list) changes;
# a half-made one (no working pip) is made again from scratch.
$(STAMP): pyproject.toml
	@if ! $(BIN)/python -m pip --version >/dev/null 2>&1; then \
	  echo "creating $(VENV) with $$($(PYTHON) --version)"; rm -rf $(VENV); \
	  $(PYTHON) -m venv $(VENV) || { echo "could not create $(VENV)" >&2; rm -rf $(VENV); exit 1; }; \
	fi
	$(BIN)/python -m pip install --quiet -e ".[test]"
	$(BIN)/python -m ipykernel install --sys-prefix --name labkit --display-name "Python (labkit)"
	@touch $@

course: $(STAMP)
	$(BIN)/labkit build --world $(WORLD) --backend $(BACKEND) --scale $(SCALE) $(if $(ONLY),--only $(ONLY))

test: $(STAMP)
	@if [ -x .ci/install-browser ]; then .ci/install-browser; fi
	@if [ -x .ci/install-postgres ]; then .ci/install-postgres; fi
	@$(BIN)/python -m pytest $(PYTEST_ARGS); status=$$?; \
	  if [ $$status -eq 5 ]; then echo "make test: pytest collected no tests: that is a failure" >&2; fi; \
	  exit $$status

lab: $(STAMP)
	$(BIN)/jupyter lab --ServerApp.root_dir=. $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS)

release: $(STAMP)
	$(BIN)/labkit release

clean:
	rm -rf build grading .pytest_cache .hypothesis
