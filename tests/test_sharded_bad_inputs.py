"""Bad inputs to the Python API: one clear error on every rank, never a wrong number.

Runs at any rank count; ``make test`` runs it serially and under mpirun with 2, 3
and 4 ranks. docs/reliability.md's table of bad inputs names these tests. The
command-line cases are in the CLI tests; launches that count a job's output
lines are in ``test_bad_inputs_launch.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.calculators.emt import EMT as AseEMT
from ase.constraints import FixAtoms
from sharded import COMM, assert_matches, cu_bulk
from toy_models import ChargedPairs

from ase_shard import ShardedCalculator
from ase_shard.comm import _EVERY_RANK
from ase_shard.distributed import distribute, gather
from ase_shard.layouts.replicated import SYNC_TOLERANCE
from ase_shard.models import EMT

pytestmark = pytest.mark.timeout(60)

LAST = COMM.size - 1
SMALL_MOVE = 1e-4  # Å, far inside the skin: the next call reuses the decomposition
LARGE_MOVE = 0.3  # Å, more than half the default skin (0.5 Å): the next call rebuilds




def _raised_together(error: pytest.ExceptionInfo) -> bool:
    """Whether the error is marked as raised by every rank of the job (one report)."""
    return bool(getattr(error.value, _EVERY_RANK, False))


# -- SPMD: a rank whose copy differs never gets a result ----------------------------------


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("step", ["reuse", "rebuild"])
# atoms from the first, middle and last third: the second call of the old check let
# atom 53 through at 3 ranks, atoms 0 and 53 at 4
@pytest.mark.parametrize("distance, atom", [(1e-6, 0), (0.1, 53), (0.4, 107), (2.0, 53)])
def test_a_diverged_copy_raises_at_once(distance: float, atom: int, step: str) -> None:
    """The last rank's copy of one atom differs (by more than round-off) on a call that
    every rank makes: every rank raises at that call, whichever atom and distance, and
    no result is stored (before: a slice per call was compared, and a mixed energy was
    returned until a later call found the atom)."""
    atoms = cu_bulk()
    atoms.calc = calc = ShardedCalculator(EMT())
    atoms.get_potential_energy()
    atoms.positions += SMALL_MOVE if step == "reuse" else LARGE_MOVE
    if COMM.rank == LAST:
        atoms.positions[atom, 1] += distance
    with pytest.raises(
        ValueError,
        match=rf"rank {LAST}: positions of 1 atom\(s\) from atom {atom}; "
        rf"by up to {distance:.3g} Å\)",
    ):
        atoms.get_potential_energy()
    assert "energy" not in calc.results
    assert calc.rebuilds == 1  # found before any rank built or evaluated anything
    atoms.positions = cu_bulk().positions
    assert_matches(atoms, AseEMT())


@pytest.mark.mpi(min_size=2)
def test_rank_0_diverging_names_every_other_rank() -> None:
    atoms = cu_bulk()
    atoms.calc = ShardedCalculator(EMT())
    atoms.get_forces()
    atoms.positions += SMALL_MOVE
    if COMM.is_root:
        atoms.positions[40] += 0.4
    others = "; ".join(
        rf"rank {r}: positions of 1 atom\(s\) from atom 40" for r in range(1, COMM.size)
    )
    with pytest.raises(ValueError, match=rf"\({others}; by up to 0.4 Å\)"):
        atoms.get_forces()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("change", ["swapped atoms", "swapped coordinates"])
def test_the_same_positions_in_another_order_raise(change: str) -> None:
    """Values that moved between places keep a copy's sums: the checksum still sees them."""
    atoms = cu_bulk()
    atoms.calc = ShardedCalculator(EMT())
    atoms.get_forces()
    atoms.positions += SMALL_MOVE
    if COMM.rank == LAST:
        if change == "swapped atoms":
            atoms.positions[[3, 70]] = atoms.positions[[70, 3]]
        else:
            atoms.positions[70] = atoms.positions[70, [1, 0, 2]]
    count = 2 if change == "swapped atoms" else 1
    with pytest.raises(ValueError, match=rf"rank {LAST}: positions of {count} atom\(s\)"):
        atoms.get_forces()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("field", ["numbers", "cell", "pbc"])
def test_other_fields_diverging_on_a_reuse_step_raise(field: str) -> None:
    atoms = cu_bulk()
    atoms.calc = ShardedCalculator(EMT())
    atoms.get_forces()
    atoms.positions += SMALL_MOVE
    expected = {
        "numbers": rf"rank {LAST}: numbers of 1 atom\(s\) from atom 60\)",
        "cell": rf"rank {LAST}: cell; by up to 1e-06 Å\)",
        "pbc": rf"rank {LAST}: pbc\)",
    }[field]
    if COMM.rank == LAST:
        if field == "numbers":
            atoms.numbers[60] = 79
        elif field == "cell":
            atoms.cell[0, 0] += 1e-6
        else:
            atoms.pbc = (True, True, False)
    with pytest.raises(ValueError, match=expected):
        atoms.get_forces()


@pytest.mark.mpi(min_size=2)
def test_model_inputs_diverging_on_a_reuse_step_raise() -> None:
    rng = np.random.default_rng(0)
    atoms = Atoms("Ar20", positions=rng.uniform(0, 9, (20, 3)), cell=[9.0] * 3, pbc=True)
    atoms.set_initial_charges(rng.normal(size=20))
    atoms.set_array("spins", rng.normal(size=20))
    atoms.info["charge"] = 0.5
    atoms.calc = ShardedCalculator(ChargedPairs(), min_distance=0)
    atoms.get_forces()
    atoms.arrays["spins"] += 0.01  # every rank: a new calculation
    if COMM.rank == LAST:
        atoms.arrays["spins"][7] += 0.01
    with pytest.raises(ValueError, match=rf"rank {LAST}: model inputs\)"):
        atoms.get_forces()


@pytest.mark.mpi(min_size=2)
def test_round_off_anywhere_is_resynchronised() -> None:
    """Round-off in any atom of one rank's copy is overwritten with rank 0's, no error."""
    atoms = cu_bulk()
    atoms.calc = ShardedCalculator(EMT())
    atoms.get_forces()
    for atom in (0, 53, 107):
        atoms.positions += SMALL_MOVE
        if COMM.rank == LAST:
            atoms.positions[atom, 2] += 0.5 * SYNC_TOLERANCE
        atoms.get_forces()
        reference = COMM.bcast(atoms.positions if COMM.is_root else None)
        assert (atoms.positions == reference).all()
    assert_matches(atoms, AseEMT())


# -- the model ---------------------------------------------------------------------------


class _NoForward(torch.nn.Module):
    cutoff, num_layers, atomic_types = 3.0, 1, None


class _Declares(torch.nn.Module):
    """A protocol model whose declarations are given."""

    def __init__(self, cutoff=3.0, num_layers=1, atomic_types=None):
        super().__init__()
        self.cutoff, self.num_layers, self.atomic_types = cutoff, num_layers, atomic_types

    def forward(self, graph):
        return graph.edge_vectors.new_zeros(graph.n_atoms)


NOT_MODELS = {
    "None": (None, "not None"),
    "ASE calculator": (AseEMT(), r"not an ASE calculator \(EMT\): .*ase_shard.models.EMT\(\)"),
    "string": ("emt", "not 'emt': load the model first"),
    "lambda": (lambda graph: graph, r"not the callable .*<lambda>: wrap it in a torch.nn.Module"),
    "class": (EMT, r"not the class EMT: pass an instance, EMT\(...\)"),
}


@pytest.mark.parametrize("name", list(NOT_MODELS))
def test_what_is_not_a_model_is_refused_at_construction(name: str) -> None:
    model, message = NOT_MODELS[name]
    with pytest.raises(TypeError, match=r"must be a torch.nn.Module .*" + message) as error:
        ShardedCalculator(model)
    assert _raised_together(error) == (COMM.size > 1)


@pytest.mark.parametrize(
    "model, missing",
    [(torch.nn.Linear(3, 1), "cutoff, num_layers, atomic_types"), (_NoForward(), "forward")],
    ids=["Linear", "no forward"],
)
def test_a_module_without_the_protocol_is_refused_at_construction(model, missing: str) -> None:
    """Before: torch.nn.Linear was accepted and failed at the first call."""
    name = type(model).__name__
    with pytest.raises(
        TypeError, match=rf"{name} does not follow the model protocol .* lacks {missing};"
    ):
        ShardedCalculator(model)


@pytest.mark.parametrize(
    "declared, message",
    [
        ({"cutoff": -1.0}, r"_Declares.cutoff must be a positive distance in Å, not -1.0"),
        ({"cutoff": float("nan")}, r"cutoff must be a positive distance in Å, not nan"),
        ({"cutoff": None}, r"cutoff must be a positive distance in Å, not None"),
        ({"num_layers": 0}, r"_Declares.num_layers must be a positive integer, not 0"),
        ({"num_layers": 2.5}, r"num_layers must be a positive integer, not 2.5"),
        ({"atomic_types": ["Cu"]}, r"atomic_types must be None .* not \['Cu'\]"),
    ],
    ids=["negative cutoff", "nan cutoff", "no cutoff", "no layers", "half layers", "symbols"],
)
def test_out_of_range_declarations_are_refused(declared: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ShardedCalculator(_Declares(**declared))


@pytest.mark.mpi(min_size=2)
def test_a_model_refused_on_one_rank_is_refused_on_every_rank() -> None:
    """Only the last rank passes no model: every rank raises its error, none waits."""
    model = None if COMM.rank == LAST else EMT()
    with pytest.raises(TypeError, match=rf"not None \[rank {LAST}\]") as error:
        ShardedCalculator(model)
    assert _raised_together(error)


# -- the other arguments -----------------------------------------------------------------


@pytest.mark.parametrize(
    "name, dtype", [("float64", torch.float64), ("float32", torch.float32)], ids=["64", "32"]
)
def test_dtype_by_name(name: str, dtype: torch.dtype) -> None:
    """The command line's spellings work as the torch dtypes do."""
    calc = ShardedCalculator(EMT(), dtype=name)
    assert calc.dtype == dtype and next(calc.model.buffers()).dtype == dtype
    if dtype == torch.float64:
        atoms = cu_bulk()
        atoms.calc = calc
        assert_matches(atoms, AseEMT())


@pytest.mark.parametrize(
    "dtype, message",
    [
        ("float16", r"dtype must be 'float32' or 'float64' .* not 'float16'"),
        ("double", r"not 'double'"),
        (np.float64, r"not <class 'numpy.float64'>"),
        (torch.int64, r"not torch.int64"),
        (torch.float16, r"dtype is torch.float16: in half precision"),
        (torch.bfloat16, r"dtype is torch.bfloat16: .* pass dtype=torch.float32"),
    ],
    ids=["float16", "double", "numpy", "int64", "torch-half", "torch-bfloat16"],
)
def test_bad_dtype_is_named(dtype, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ShardedCalculator(EMT(), dtype=dtype)


def test_a_half_precision_model_needs_a_dtype() -> None:
    with pytest.raises(ValueError, match=r"the model's dtype is torch.bfloat16"):
        ShardedCalculator(EMT().to(torch.bfloat16))
    assert ShardedCalculator(EMT().to(torch.bfloat16), dtype="float32").dtype == torch.float32


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"skin": -0.1}, r"skin must be a finite distance >= 0 Å, not -0.1"),
        ({"skin": float("nan")}, r"skin must be a finite distance >= 0 Å, not nan"),
        ({"skin": "0.5 Å"}, r"skin must be a finite distance >= 0 Å, not '0.5 Å'"),
        ({"timeout": 0}, r"timeout must be a positive number of seconds or None, not 0"),
        ({"partition": "random"}, r"partition must be one of .*, not 'random'"),
        ({"balance": "time"}, r"balance must be one of \('work', 'count'\), not 'time'"),
        ({"halo": "wide"}, r"halo must be one of .*, not 'wide'"),
        ({"neighbor_list": "fast"}, r"neighbor_list must be one of .*, not 'fast'"),
        ({"grid": (1, 1)}, r"grid must be three positive integers that multiply to \d+ ranks"),
        ({"grid": 2}, r"grid must be three positive integers .* not 2"),
        ({"device": "tpu:7"}, r"device 'tpu:7' is not a torch device; available here: cpu"),
    ],
    ids=[
        "skin negative",
        "skin nan",
        "skin string",
        "timeout",
        "partition",
        "balance",
        "halo",
        "neighbor_list",
        "grid two",
        "grid int",
        "device",
    ],
)
def test_bad_arguments_are_named_on_every_rank(arguments: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message) as error:
        ShardedCalculator(EMT(), **arguments)
    assert _raised_together(error) == (COMM.size > 1)


def test_a_communicator_that_is_not_one_is_refused() -> None:
    """No communicator to agree through: each rank raises, marked for one report."""
    with pytest.raises(TypeError, match="comm must be an mpi4py communicator or None, not 'wo"):
        ShardedCalculator(EMT(), comm="world")


# -- distribute --------------------------------------------------------------------------


def _object_array() -> Atoms:
    atoms = cu_bulk()
    atoms.arrays["labels"] = np.array(["Cu"] * len(atoms), dtype=object)
    return atoms


def _constrained() -> Atoms:
    atoms = cu_bulk()
    atoms.set_constraint(FixAtoms([0]))
    return atoms


@pytest.mark.parametrize(
    "make, kind, message",
    [
        (lambda: None, TypeError, r"distribute: the root rank must pass an ase.Atoms, not None"),
        (lambda: "cu.xyz", TypeError, r"must pass an ase.Atoms, not 'cu.xyz'"),
        (_constrained, ValueError, r"constraints are not supported on distributed atoms"),
        (_object_array, ValueError, r"per-atom array 'labels' holds Python objects"),
    ],
    ids=["None", "file name", "constraints", "object array"],
)
def test_distribute_refuses_on_every_rank(make, kind: type, message: str) -> None:
    with pytest.raises(kind, match=message + r".* \[rank 0\]") as error:
        distribute(make())
    assert _raised_together(error) == (COMM.size > 1)


def test_distributing_distributed_atoms_is_refused() -> None:
    local = distribute(cu_bulk())
    with pytest.raises(TypeError, match="distributed already; gather"):
        distribute(local)


@pytest.mark.mpi(min_size=2)
def test_distribute_takes_the_roots_system_when_copies_differ() -> None:
    """Ranks that pass their own, different copies get the root's atoms, not a mix."""
    atoms = cu_bulk()
    atoms.rattle(0.01, seed=COMM.rank)  # each rank's copy differs
    atoms.set_momenta(np.full((len(atoms), 3), float(COMM.rank)))
    whole = gather(distribute(atoms))
    if COMM.is_root:
        assert (whole.positions == atoms.positions).all()
        assert (whole.get_momenta() == 0.0).all()
