"""Execute every notebook in ``notebooks/`` at its small size (``D3PEXT_NOTEBOOK_SMALL=1``).

Needs the ``[notebooks]`` extra (nbclient, nbformat, ipykernel); skipped with the reason otherwise.
"""

import os
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 600  # catches a hung cell; a notebook's small size is meant to run in well under a minute


def _missing_requirements() -> str:
    missing = []
    for module in ("nbclient", "nbformat", "ipykernel", "matplotlib"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    return ", ".join(missing)


# Notebooks whose CI size takes 35-50 s on the shared 2-core machine, almost all of it compiling
# (SPPE's and SPLE's flows, NUTS and the IS reference; six Poisson-factorization Gibbs samplers; six
# bounded-Gaussian samplers; four regression samplers, two epsilons by two variants): run with
# ``pytest -m slow``; their code paths have fast twins in the unit tests (test_sbi.py's SPPE/SPLE fits,
# test_sir.py's ABC, test_naive_bayes.py's simulator, test_counts.py, test_bounded.py's posteriors of the
# same blood-lead release, test_regression.py's samplers and test_readme.py's run of the README's
# constrained regression, the notebook's model and release). The others take 21-32 s.
HEAVY = {
    "sppe_sple.ipynb", "locally_private_counts.ipynb", "sppe_sir.ipynb", "sppe_naive_bayes.ipynb",
    "bounded_gaussian.ipynb", "constrained_regression.ipynb",
}


@pytest.mark.parametrize(
    "path",
    [pytest.param(p, marks=pytest.mark.slow) if p.name in HEAVY else p for p in NOTEBOOKS],
    ids=[p.name for p in NOTEBOOKS],
)
def test_notebook_runs(path, monkeypatch, tmp_path):
    missing = _missing_requirements()
    if missing:
        pytest.skip(f"needs the [notebooks] extra: {missing} not installed")
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("D3PEXT_NOTEBOOK_SMALL", "1")
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError, with the cell's traceback, if a cell fails
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors


def test_notebooks_found():
    assert NOTEBOOKS, "no notebooks found in notebooks/"
    assert all(os.path.getsize(p) > 0 for p in NOTEBOOKS)
