# The two commands: `make demo` (MD on 2 MPI ranks) and `make test` (all tests).
# Both create .venv on first use and install torch first (CPU build by default).

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
DEMO_RANKS ?= 2
MPI_RANKS ?= 2 3 4

BIN := $(VENV)/bin
STAMP := $(VENV)/.ase-shard-installed

# Open MPI refuses root without these; one thread per rank avoids oversubscription.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export PRTE_ALLOW_RUN_AS_ROOT := 1
export PRTE_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export OMP_NUM_THREADS := 1

MPIRUN := $(BIN)/mpirun --oversubscribe
# every mpirun is bounded: a hang fails the run instead of eating the CI budget
GUARD := timeout -k 15

.PHONY: demo test lint install

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e ".[mpi,test]"
	touch $@

demo: $(STAMP)
	$(GUARD) 900 $(MPIRUN) -n $(DEMO_RANKS) $(BIN)/ase-shard md --system cu-bulk --size 9 \
		--steps 200 --log - --interval 20

lint: $(STAMP)
	$(BIN)/ruff check ase_shard tests examples scripts

test: lint
	$(GUARD) 900 $(BIN)/python -m pytest -q
	set -e; for n in $(MPI_RANKS); do \
		echo "== pytest under mpirun -n $$n"; \
		$(GUARD) 600 $(MPIRUN) -n $$n $(BIN)/python -m pytest -q --with-mpi \
			-p no:cacheprovider tests/test_sharded_*.py; \
	done
