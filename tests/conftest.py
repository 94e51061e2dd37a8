"""Test-session configuration shared by all test modules."""

from __future__ import annotations

import gc
import os

import pytest

# The test run neither reads nor writes the user's persistent compilation cache (the CLI and the
# notebooks turn it on, d3pext.compile_cache): tests stay independent of earlier runs and of the
# user's home. D3PEXT_NO_COMPILE_CACHE=0 in the environment lets a local run use the cache.
os.environ.setdefault("D3PEXT_NO_COMPILE_CACHE", "1")


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile``, except that each notebook is a work unit of its own.

    Test modules stay whole (their module-scoped fixtures hold compiled samplers), but the
    notebooks, which take one to three minutes each at their CI size, are units of their own,
    handed out first: they spread over the workers while the other files fill in, instead of
    running last, one after another, on a run that has otherwise finished.
    """
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class NotebooksApart(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if "test_notebooks.py::test_notebook_runs[" in nodeid:
                return nodeid
            return super()._split_scope(nodeid)

        def _assign_work_unit(self, node) -> None:
            # xdist queues the biggest files first and these one-test units last, where each of
            # them (one to three minutes) would run alone at the end: hand them out first instead
            for scope in [s for s in self.workqueue if "test_notebooks.py::" in s]:
                self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return NotebooksApart(config, log)


# ------------------------------------------------------------ slow tests left out, in the summary

_slow_deselected: set[str] = set()  # node ids deselected in this process
_slow_deselected_by_workers = 0  # on the xdist controller, which collects nothing itself


def pytest_deselected(items):
    _slow_deselected.update(item.nodeid for item in items if item.get_closest_marker("slow"))


def pytest_collection_finish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: it collected the whole run; tell the controller
        workeroutput["slow_deselected"] = len(_slow_deselected)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    global _slow_deselected_by_workers
    count = getattr(node, "workeroutput", {}).get("slow_deselected", 0)
    _slow_deselected_by_workers = max(_slow_deselected_by_workers, count)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    count = max(len(_slow_deselected), _slow_deselected_by_workers)
    if count and not hasattr(config, "workerinput"):
        terminalreporter.write_line(f"{count} slow test{'s' * (count != 1)} deselected; run them with: pytest -m slow")


# ------------------------------------------------ a quick exit for xdist workers

# When the last xdist worker reports that it has finished, the controller tells every worker to
# exit; a worker still busy 5 s later gets a SIGINT from execnet, and the KeyboardInterrupt
# traceback it may print ends a green run. What a worker does after reporting: the terminal
# summary hooks (hence -p no:hypothesispytest in pyproject.toml: hypothesis's plugin imported
# the whole of hypothesis there, seconds of CPU) and pytest's hunt for unraisable exceptions,
# five full garbage collections over a heap full of JAX objects. One full collection here, with
# the unraisable-exception hook still in place, then freezing the survivors, leaves those five
# almost nothing to walk.


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    if hasattr(config, "workerinput"):
        gc.collect()
        gc.freeze()
