"""Draw docs/img/halo_modes.png: which atoms a rank evaluates with each halo.

Pure geometry (the partition and halo code the calculator runs, no MPI, no
model), so the figure is exact and cheap to regenerate::

    .venv/bin/python scripts/plot_halo.py [--out docs/img/halo_modes.png]

Left: a Cu(100) slab split over 4 ranks; rank 0's owned atoms, its ghosts
with a one-cutoff halo (``halo="layer"``) and the extra ghosts a 3-layer
model needs with the full receptive-field halo (``halo="full"``). Right:
evaluated atoms per owned atom (nodes / owned) against atoms per rank, for
bulk Cu on 8 ranks, a 5 Å cutoff with 3 and 5 layers.
"""

from __future__ import annotations

import argparse

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from ase.build import bulk, fcc100  # noqa: E402

from ase_shard.halo import rank_rows  # noqa: E402
from ase_shard.partition import choose_grid, frame_coordinates, spatial_owners  # noqa: E402

CUTOFF, SKIN = 5.0, 0.5


def layout(atoms, n_ranks: int, width: float, fold_foreign: bool, grid=None):
    pbc = atoms.pbc.copy()
    coords = frame_coordinates(atoms.positions, atoms.cell.array, pbc)
    grid = grid or choose_grid(coords, pbc, n_ranks, width)
    owners = spatial_owners(coords, tuple(grid))
    return rank_rows(coords, pbc, owners, n_ranks, width, fold_foreign)


def padding(atoms, n_ranks: int, layers: int, halo: str) -> float:
    """Mean nodes / owned over the ranks."""
    width = (CUTOFF if halo == "layer" else CUTOFF * layers) + SKIN
    rows = layout(atoms, n_ranks, width, halo == "layer")
    return float(np.mean([r.n_nodes / max(r.n_owned, 1) for r in rows]))


def draw_slab(ax) -> None:
    slab = fcc100("Cu", size=(24, 24, 2), vacuum=5.0)
    cell = slab.cell.array
    grid = (2, 2, 1)
    rows = {
        halo: layout(slab, 4, width, halo == "layer", grid)[0]
        for halo, width in (("layer", CUTOFF + SKIN), ("full", 3 * CUTOFF + SKIN))
    }

    def images(r, pick):
        return slab.positions[r.ids[pick]] + r.image_shift[pick] @ cell

    def ghost_images(r):
        """Every image of a ghost atom, drawn where it acts on rank 0's atoms."""
        return images(r, r.node >= r.n_owned)

    full, layer = rows["full"], rows["layer"]
    owned = images(layer, np.arange(layer.n_owned))
    ax.scatter(*slab.positions[:, :2].T, s=3, c="0.85", label="other atoms")
    for r, colour, label in (
        (full, "tab:orange", f"ghosts, full halo (3 x {CUTOFF:g} Å)"),
        (layer, "tab:red", f"ghosts, layer halo ({CUTOFF:g} Å)"),
    ):
        ax.scatter(*ghost_images(r)[:, :2].T, s=4, c=colour, label=label)
    ax.scatter(*owned[:, :2].T, s=4, c="tab:blue", label="owned by rank 0")
    ax.set_aspect("equal")
    ax.set_xlabel("x (Å)")
    ax.set_ylabel("y (Å)")
    ax.set_title(
        f"rank 0 of 4: {layer.n_owned} owned, ghosts {layer.n_nodes - layer.n_owned} "
        f"(layer) / {full.n_nodes - full.n_owned} (full)",
        fontsize=9,
    )
    ax.legend(fontsize=7, loc="upper right", markerscale=3)


def draw_padding(ax) -> None:
    n_ranks = 8
    sizes = [6, 8, 10, 12, 16, 20, 24]
    per_rank = [4 * n**3 / n_ranks for n in sizes]
    for layers, style in ((3, "-"), (5, "--")):
        full = [padding(bulk("Cu", cubic=True).repeat(n), n_ranks, layers, "full") for n in sizes]
        ax.plot(per_rank, full, "o" + style, c="tab:orange", label=f"full halo, {layers} layers")
    layer = [padding(bulk("Cu", cubic=True).repeat(n), n_ranks, 1, "layer") for n in sizes]
    ax.plot(per_rank, layer, "s-", c="tab:red", label="layer halo, any depth")
    ax.axhline(1.0, c="0.6", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("owned atoms per rank (bulk Cu, 8 ranks)")
    ax.set_ylabel("evaluated / owned atoms")
    ax.set_title(f"cost padding, cutoff {CUTOFF:g} Å, skin {SKIN:g} Å", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/img/halo_modes.png")
    args = parser.parse_args()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.8))
    draw_slab(left)
    draw_padding(right)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
