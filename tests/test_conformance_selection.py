"""Which of ASE's test files the conformance run (``tests/ase_conformance``) selects."""

from __future__ import annotations

import pytest

from tests.ase_conformance.swap import ASE_TESTS, selected


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("emt/test_emt.py", True),
        # names asap3's EMT only (``asap3.EMT()``): the swap does not replace it
        ("md/test_nvt_npt.py", False),
        ("md/test_verlet_thermostats_asap.py", False),
        # ``EMT = asap3.EMT`` then ``EMT()``: a bare name, so selected
        ("md/test_phonon_md_init.py", True),
        ("cli/test_run.py", False),  # LEFT_OUT
    ],
)
def test_selected(path: str, expected: bool) -> None:
    assert selected(ASE_TESTS / path) is expected
