"""Test-session configuration shared by all test modules."""

from __future__ import annotations


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile``, except that each notebook is a work unit of its own.

    Test modules stay whole (their module-scoped fixtures hold compiled samplers), but the
    notebooks, which take one to three minutes each at their CI size, spread over the workers
    instead of running one after another on a single worker at the end of the run.
    """
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class NotebooksApart(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if "test_notebooks.py::test_notebook_runs[" in nodeid:
                return nodeid
            return super()._split_scope(nodeid)

    return NotebooksApart(config, log)
