"""When a decomposition may be reused (numpy and one compiled loop, no MPI).

A decomposition (owners, ghosts, neighbour lists) is built with a skin: it
stays valid while every pair now within the halo's reach was within reach plus
skin at the build. :func:`forced_rebuild` answers from what every rank sees
alike (atom count, pbc, the cell); :func:`displacement_reason` from this
rank's own atoms, and the ranks vote on it.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from ase_shard.layouts.base import Decomposition

# above this strain (spectral norm of F - I) the cell is rebuilt outright
_MAX_STRAIN = 0.5


def strain(deformation: np.ndarray) -> float:
    """Spectral norm of ``F - I`` for a cell deformation ``F``."""
    return float(np.linalg.norm(deformation - np.eye(3), ord=2))


def forced_rebuild(
    state: Decomposition | None, n_atoms: int, cell: np.ndarray, changed: bool
) -> tuple[str | None, np.ndarray | None]:
    """A rebuild reason every rank sees alike, and the cell deformation since the build.

    Parameters
    ----------
    state : Decomposition or None
        The current decomposition (``None``: none yet).
    n_atoms : int
        Atoms of the system now.
    cell : (3, 3) array
        The cell now (Å).
    changed : bool
        Numbers or pbc changed since the last calculation.

    Returns
    -------
    reason : str or None
        Why the decomposition must be rebuilt; ``None``: it may be reused.
    deformation : (3, 3) array or None
        ``F`` with ``cell = cell_at_build @ F``; ``None`` when the cell did not
        change or a rebuild is due anyway.
    """
    if state is None:
        return "first call", None
    if n_atoms != state.n_atoms or changed:
        return "atoms or pbc changed", None
    if (cell == state.cell).all():
        return None, None
    if np.count_nonzero(state.cell.any(axis=1)) < 3:
        return "cell changed", None
    try:
        deformation = np.linalg.solve(state.cell, cell)
    except np.linalg.LinAlgError:
        return "cell changed", None
    if strain(deformation) >= _MAX_STRAIN:
        return "cell changed", None
    return None, deformation


def displacement_reason(
    state: Decomposition,
    positions: np.ndarray,
    deformation: np.ndarray | None,
    reach: float,
    skin: float,
) -> str | None:
    """Why pair distances may have changed by more than the skin (this rank's atoms).

    Reuse is safe while every pair now within the halo reach ``W`` was
    within ``W + skin`` at the build. With the cell deformed by ``F`` (a
    barostat) and each atom displaced by ``u_i`` beyond that affine map, a
    pair vector changes by at most ``|F - I| |d0| + 2 max |u|``, which
    gives the test ``(W |F - I| + 2 max |u|) / (1 - |F - I|) <= skin``.
    Without a cell change this is the usual ``max |u| <= skin / 2``. The
    ranks combine their own atoms' verdicts.

    Parameters
    ----------
    state : Decomposition
        With the owned atoms' positions at the build.
    positions : (n, 3) array
        This rank's node positions now (Å); the owned ones come first.
    deformation : (3, 3) array or None
        From :func:`forced_rebuild`.
    reach, skin : float
        Å.
    """
    reference = state.owned_positions
    if deformation is not None:
        reference = reference @ deformation
    stretch = 0.0 if deformation is None else strain(deformation)
    displacement = math.sqrt(_largest_squared_displacement(positions, reference))
    growth = (reach * stretch + 2.0 * displacement) / (1.0 - stretch)
    if growth > skin:
        return f"pair distances may have changed by {growth:.3f} Å > skin"
    return None


@numba.njit(cache=True)
def _largest_squared_displacement(positions, reference):  # pragma: no cover - compiled
    """``max |positions[i] - reference[i]|^2`` over the rows of ``reference`` (Å²).

    One pass, no temporary: numpy's difference, its lengths and their maximum
    read and wrote three arrays the size of the positions (2.6 ms a step of
    256,000 atoms). Non-finite positions are the validation's to report.
    """
    largest = 0.0
    for i in range(reference.shape[0]):
        dx = positions[i, 0] - reference[i, 0]
        dy = positions[i, 1] - reference[i, 1]
        dz = positions[i, 2] - reference[i, 2]
        squared = dx * dx + dy * dy + dz * dz
        if squared > largest:
            largest = squared
    return largest
