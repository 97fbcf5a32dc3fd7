"""``ase-shard bench``: what ``ShardedCalculator`` costs, measured against references.

Two measurements, each one function that every rank calls and that returns a
JSON-encodable report on rank 0:

- :func:`run_benchmark` (``ase-shard bench``): the bare model, ``ShardedCalculator``
  on one rank and on all ``P`` ranks, optionally ASE's own calculator, and the
  machine's ceiling for the speed-up, step by step in turns;
- :func:`run_framework` (``ase-shard bench --framework``): ``ShardedCalculator``'s
  cost per MD step next to ASE's own ``VelocityVerlet`` step.

:func:`format_summary`, :func:`format_framework_summary` and :func:`plot_report`
read a report back. The modules, each importing only those listed after it:

- :mod:`~ase_shard.bench.report`: the plain-text summaries and the PNG;
- :mod:`~ase_shard.bench.framework`: :func:`run_framework` and its settings;
- :mod:`~ase_shard.bench.harness`: :func:`run_benchmark`, its settings, subjects,
  timed steps and ratios;
- :mod:`~ase_shard.bench.run`: what both measurements share: the step settings,
  the kinds of steps, the per-rank phase breakdowns and the report's header;
- :mod:`~ase_shard.bench.bare`: the bare model, the reference of every timing;
- :mod:`~ase_shard.bench.machine`: memory, the ceiling and the environment of the
  process and the machine (also used by ``scripts/``).

The models it times with random weights are in :mod:`ase_shard.random_models`.
"""

from ase_shard.bench.framework import FrameworkSettings, run_framework
from ase_shard.bench.harness import BenchSettings, run_benchmark
from ase_shard.bench.report import format_framework_summary, format_summary, plot_report

__all__ = [
    "BenchSettings",
    "FrameworkSettings",
    "format_framework_summary",
    "format_summary",
    "plot_report",
    "run_benchmark",
    "run_framework",
]
