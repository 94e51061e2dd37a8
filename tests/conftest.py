"""Test-session configuration shared by all test modules."""

from __future__ import annotations

import atexit
import gc
import os
import shutil
import tempfile

import jax
import pytest

# The test run neither reads nor writes the user's persistent compilation cache (the CLI and the
# notebooks turn it on, d3pext.compile_cache): tests stay independent of earlier runs and of the
# user's home. D3PEXT_NO_COMPILE_CACHE=0 in the environment lets a local run use the cache.
os.environ.setdefault("D3PEXT_NO_COMPILE_CACHE", "1")

# Each test process instead keeps a compilation cache of its own, in a temporary directory deleted
# at exit. Many tests build their own DPSVI objects (or samplers) for the same model: new functions
# to JAX, whose jit caches then miss, but the same XLA programs, which this cache finds (test_svi.py
# took 22% less CPU time). Not shared between processes (JAX writes its entries in place, so another
# process could read one half written) and not passed on to subprocesses. Programs read from it
# still count as compilations where tests count them (tests/compilations.py; test_compile_once.py).
_PROCESS_CACHE = tempfile.mkdtemp(prefix="d3pext-tests-xla-cache-")
atexit.register(shutil.rmtree, _PROCESS_CACHE, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _PROCESS_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.05)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


# Seconds each of the longest work units takes in the default run, measured one file at a time on
# the 2-core machine (CPU seconds; notebooks at their CI size). Only the order matters: xdist hands
# out work units first to last, and by default orders them by their number of tests, which put the
# longest files (few tests, a minute or more each: flows, multihost, docs, devices, calibration)
# last, where the run then waited for them alone. Longest first instead; a unit left out counts as
# 0 (a notebook left out, 120) and keeps xdist's order after these (the many small files fill in
# at the end).
LONGEST = {
    "tests/test_svi.py": 165,
    "tests/test_minibatch.py": 110,
    "tests/test_sbi.py": 100,  # with tests/test_arviz.py (SAME_UNIT)
    "tests/test_counts.py": 100,
    "tests/test_models.py": 100,
    "tests/test_multihost.py": 95,  # three JAX processes at once
    "tests/test_tgm.py": 80,
    "tests/test_readme.py": 80,
    "tests/test_flows.py": 75,
    "tests/test_accelerator_forms.py": 65,
    "tests/test_expfam.py": 55,
    "tests/test_notebooks.py::test_notebook_runs[expfam_calibration.ipynb]": 48,
    "tests/test_notebooks.py::test_notebook_runs[dpvi_hierarchical_logistic.ipynb]": 46,
    "tests/test_notebooks.py::test_notebook_runs[bounded_gaussian.ipynb]": 27,
    "tests/test_notebooks.py::test_notebook_runs[sppe_naive_bayes.ipynb]": 25,
    "tests/test_notebooks.py::test_notebook_runs[sppe_sir.ipynb]": 24,
    "tests/test_notebooks.py::test_notebook_runs[constrained_regression.ipynb]": 22,
    "tests/test_handlers.py": 45,
    "tests/test_compile_once.py": 45,  # with the demo's programs in two subprocesses
    "tests/test_data_parallel.py": 43,
    "tests/test_docs.py": 36,
    "tests/test_dpsvi_safety.py": 36,
    "tests/test_naive_bayes.py": 32,
    "tests/test_devices.py": 27,
    "tests/test_cli.py": 26,
    "tests/test_calibration.py": 24,
    "tests/test_doctests.py": 20,
    "tests/test_sir.py": 20,
    "tests/test_cached_mcmc.py": 18,
    "tests/test_rqmc.py": 18,
    "tests/test_checkpoint.py": 18,
    "tests/test_regression.py": 17,
    "tests/test_ghost.py": 16,
    "tests/test_ledger.py": 16,
}

# Files that share what a test process computes once (tests/sbi_fits.py: one SPPE fit, about 35 s of
# compilation) run in one work unit, on one worker, which then computes it once.
SAME_UNIT = {"tests/test_arviz.py": "tests/test_sbi.py"}


def _expected_seconds(scope: str) -> float:
    # a notebook left out of LONGEST is a slow one (pytest -m slow: one to three minutes each)
    return LONGEST.get(scope, 120 if "test_notebooks.py::" in scope else 0)


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile``, with each notebook a work unit of its own, the files of SAME_UNIT
    together, and the longest units (LONGEST) handed out first.

    Test modules stay whole (their module-scoped fixtures hold compiled samplers), but the
    notebooks, which take about a minute each at their CI size, are units of their own, so that
    they spread over the workers while the other files fill in.
    """
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LongestFirst(LoadFileScheduling):
        _ordered = False

        def _split_scope(self, nodeid: str) -> str:
            if "test_notebooks.py::test_notebook_runs[" in nodeid:
                return nodeid
            scope = super()._split_scope(nodeid)
            return SAME_UNIT.get(scope, scope)

        def _assign_work_unit(self, node) -> None:
            # the queue is complete at the first assignment: reorder it once (sorted() is stable)
            if not self._ordered:
                self._ordered = True
                order = sorted(self.workqueue, key=lambda scope: -_expected_seconds(scope))
                for scope in order:
                    self.workqueue.move_to_end(scope)
            super()._assign_work_unit(node)

    return LongestFirst(config, log)


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
