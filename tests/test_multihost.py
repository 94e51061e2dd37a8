"""Multi-host data-parallel DPSVI: ``jax.distributed`` with 2 local processes x 2 forced CPU devices.

The script is the README's "Scale out" block, run as README.md says: once as one process on one device,
and as 2 processes (coordinator on 127.0.0.1, a free port; ``XLA_FLAGS`` forcing 2 CPU devices each;
JAX's default Gloo CPU collectives), each loading only its half of the records and assembling the global
array with :func:`~d3pext.training.parallel.shard_records`. Checked: the same key gives the same fit.
Then :func:`~d3pext.training.parallel.shard_records` refuses, across processes, halves of unequal
size. The processes share this machine's cores: this checks results, not speed.

The one-process run is also the README check of this block (``tests/test_readme.py`` leaves it to this
file): it runs as written, in a fresh interpreter and a temporary folder, and must print the fit.
"""

from __future__ import annotations

import ast
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
SCRIPT = re.findall(r"^```python\n(.*?)^```", README.split("## Scale out", 1)[1], re.S | re.M)[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int | None, port: int | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COORDINATOR_ADDRESS")}
    env.update(JAX_PLATFORMS="cpu", PYTHONWARNINGS="ignore")
    if devices:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    if port:
        env["JAX_COORDINATOR_ADDRESS"] = f"127.0.0.1:{port}"
    return env


def _start(code: str, args: list[str], env: dict, cwd: Path = ROOT) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(procs: list[subprocess.Popen], timeout: float = 600) -> list[str]:
    """Wait for every process; on a failure or a timeout stop the others (they would wait for the
    coordinator) and report the failure."""
    outs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, f"process failed (exit {proc.returncode}):\n{err[-4000:]}"
            outs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return outs


def _fitted(out: str) -> tuple[int, list[float]]:
    found = re.search(r"devices: (\d+) w: (\[[^\]]*\])", out)
    assert found, out
    return int(found.group(1)), json.loads(found.group(2))


def test_two_processes_of_two_devices_give_the_fit_of_one_process(tmp_path):
    ast.parse(SCRIPT)  # a syntax error reports the block, not a subprocess traceback
    port = _free_port()
    # all three at once: the reference (one process, one device: the README block run as written) and
    # the two processes of the mesh; in a temporary folder, as tests/test_readme.py runs README blocks
    procs = [_start(SCRIPT, [], _env(None), tmp_path)]
    procs += [_start(SCRIPT, ["2", str(i)], _env(2, port), tmp_path) for i in range(2)]
    one, first, second = _finish(procs)
    devices, w_one = _fitted(one)
    assert devices == 1
    devices, w_two = _fitted(first)
    assert devices == 4
    assert "w:" not in second  # only process 0 prints
    np.testing.assert_allclose(w_two, w_one, rtol=1e-4, atol=1e-5)
    assert max(abs(a - b) for a, b in zip(w_one, [1.0, -1.0, 0.5])) < 0.3  # and the fit is a fit


UNEVEN = """
import sys, jax
jax.distributed.initialize(num_processes=2, process_id=int(sys.argv[1]))
import numpy as np
from jax.sharding import Mesh
from d3pext.training.parallel import process_slice, shard_records
mesh = Mesh(jax.devices(), ("data",))
assert process_slice(8, mesh) == slice(4 * jax.process_index(), 4 * jax.process_index() + 4)
x = np.zeros((4 if jax.process_index() == 0 else 6, 3), np.float32)   # process 1 loaded too many rows
try:
    shard_records((x, x[:, 0]), mesh)
except ValueError as e:
    print("refused:", e)
"""


def test_processes_holding_rows_of_different_sizes_are_refused():
    port = _free_port()
    outs = _finish([_start(UNEVEN, [str(i)], _env(2, port)) for i in range(2)])
    for out in outs:
        assert "refused: the processes hold rows of different shapes for leaf 0" in out, out
        assert "process 0: (2, 3); process 1: (3, 3)" in out, out


KEYS = """
import sys, jax
jax.distributed.initialize(num_processes=2, process_id=int(sys.argv[1]))
import numpy as np, numpyro, numpyro.distributions as dist
from jax.sharding import Mesh
from jax.experimental import multihost_utils
from d3pext import DPSVI
from d3pext.training.parallel import process_slice, shard_records
N, B = 8, 4
def model(x):
    mu = numpyro.sample("mu", dist.Normal(0.0, 1e4))
    with numpyro.plate("data", x.shape[0], subsample_size=B):
        numpyro.sample("x", dist.Normal(mu, 1.0), obs=numpyro.subsample(x, event_dim=0))
def guide(x):
    numpyro.sample("mu", dist.Delta(numpyro.param("loc", 0.0)))
mesh = Mesh(jax.devices(), ("data",))
(x,) = shard_records((np.zeros(N, np.float32)[process_slice(N, mesh)],), mesh)
svi = DPSVI(model, guide, numpyro.optim.SGD(1.0), clipping_threshold=1.0, dp_scale=1.0, mesh=mesh)
result = svi.run(None, 3, x, progress_bar=False)  # records all 0: loc is the noise alone
loc = float(np.asarray(result.params["loc"].addressable_data(0)))
print("locs:", np.asarray(multihost_utils.process_allgather(np.float32(loc))).tolist())
try:
    svi.run(jax.random.key(jax.process_index()), 3, x, progress_bar=False)
except ValueError as e:
    print("refused:", e)
"""


def test_processes_share_the_secure_key_and_refuse_different_keys():
    """rng_key=None across processes: process 0's secure key for all (each drew its own, so each added
    its own noise to one clipped sum and the replicated parameters parted); different keys: refused."""
    port = _free_port()
    outs = _finish([_start(KEYS, [str(i)], _env(2, port)) for i in range(2)])
    for out in outs:
        locs = json.loads(re.search(r"locs: (\[[^\]]*\])", out).group(1))
        assert len(locs) == 2 and locs[0] == locs[1] and locs[0] != 0.0, out
        assert "refused: the processes of the mesh hold different rng_keys" in out, out
