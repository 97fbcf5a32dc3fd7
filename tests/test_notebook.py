"""The example notebook runs headlessly, spawns its workers and leaves none behind."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "cu_nanoparticle.ipynb"


def _workers_alive() -> bool:
    listing = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return any("worker_main" in line and "ps -eo" not in line for line in listing.splitlines())


def test_notebook_runs_and_plots(monkeypatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    for name in [n for n in os.environ if n.startswith(("OMPI_COMM_WORLD", "PMIX_", "PMI_"))]:
        monkeypatch.delenv(name)  # the kernel must be a plain process even under mpirun
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(notebook, timeout=300, kernel_name="python3").execute()

    outputs = [out for cell in notebook.cells if cell.cell_type == "code" for out in cell.outputs]
    assert not [out for out in outputs if out.output_type == "error"]
    images = [out for out in outputs if "image/png" in out.get("data", {})]
    assert len(images) == 2
    text = "".join(out.get("text", "") for out in outputs)
    assert "3 ranks" in text
    drift = float(text.split("total-energy drift: ")[1].split()[0])
    assert abs(drift) < 1e-3

    deadline = time.monotonic() + 20
    while _workers_alive() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _workers_alive()
