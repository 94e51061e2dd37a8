"""d3pext._threefry_cpu: Threefry on a CPU over one flat axis gives JAX's bits, bit for bit."""

import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from d3pext import _threefry_cpu
from d3pext._threefry_cpu import threefry2x32_20

# Random123's known answers for Threefry-2x32 with 20 rounds: (key, counter) -> output
KNOWN_ANSWERS = [
    ((0x00000000, 0x00000000), (0x00000000, 0x00000000), (0x6B200159, 0x99BA4EFE)),
    ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
    ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0)),
]


@pytest.mark.parametrize("key, counter, expected", KNOWN_ANSWERS)
def test_random123_known_answers(key, counter, expected):
    k1, k2, x1, x2 = (np.uint32(v) for v in (*key, *counter))
    assert tuple(int(v) for v in threefry2x32_20(k1, k2, x1, x2)) == expected
    # the same through the primitive, in a multi-dimensional counter array, keys broadcast
    shape = (2, 3, 4)
    y1, y2 = jax.jit(jax.extend.random.threefry2x32_p.bind)(
        k1, k2, np.full(shape, x1, np.uint32), np.full(shape, x2, np.uint32)
    )
    assert (np.asarray(y1) == expected[0]).all() and (np.asarray(y2) == expected[1]).all()


# Draws of many shapes and kinds, as hex digests, in a fresh process (with or without the flat lowering).
_DRAWS = r"""
import hashlib, json, sys
import jax, numpy as np
import d3pext._backend, d3pext._threefry_cpu as t
k = jax.random.key(11)
keys = jax.random.split(k, 3)


# one program for all (each eager draw compiled a program of its own: 2.5x the time), one draw eager
def all_draws(k, keys):
    return {
        "bits": jax.random.bits(k, (2, 9, 5)),
        "bits1": jax.random.bits(k, (7,)),
        "bits64": jax.random.bits(k, (3, 4), np.uint64) if jax.config.jax_enable_x64 else jax.random.bits(k, (3, 4), np.uint16),
        "normal": jax.random.normal(k, (4, 3, 2)),
        "uniform": jax.random.uniform(k, (2, 2, 2, 3)),
        "poisson": jax.random.poisson(k, 3.0, (3, 4, 5)),
        "gamma": jax.random.gamma(k, 0.7, (2, 3, 4)),
        "split": jax.random.key_data(jax.random.split(k, (2, 3))),
        "fold_in": jax.random.key_data(jax.random.fold_in(k, 12345)),
        "scalar": jax.random.normal(k, ()),
        "bits31": jax.random.bits(k, (31,)),  # the flat loop over 32 counters, the last dropped
        "vmapped": jax.vmap(lambda key: jax.random.normal(key, (5, 6)))(keys),
        "jitted": jax.jit(lambda key: jax.random.randint(key, (3, 5, 7), 0, 100))(k),
        "large": jax.random.bits(k, (t.FLAT_MAX_SIZE // 64 + 1, 8, 8)),  # above the flat size: JAX's lowering
    }


draws = {**jax.jit(all_draws)(k, keys), "eager": jax.random.normal(k, (4, 3, 2))}
out = {name: hashlib.sha1(np.asarray(v).tobytes()).hexdigest() for name, v in draws.items()}
print(json.dumps({"installed": t.installed(), "draws": out}))
"""


def _draws(**env):
    run_env = {**os.environ, "JAX_PLATFORMS": "cpu", **env}
    proc = subprocess.run([sys.executable, "-c", _DRAWS], capture_output=True, text=True, timeout=300,
                          env=run_env, check=True)  # fmt: skip
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_same_bits_as_jax_and_the_opt_out():
    flat = _draws()
    jax_own = _draws(D3PEXT_KEEP_JAX_THREEFRY="1")
    assert flat["installed"] == (_threefry_cpu._jax_cpu_rule is not None)
    assert jax_own["installed"] is False
    assert flat["draws"] == jax_own["draws"]


def _cpu_text(fn) -> str:
    return jax.jit(fn).trace(jax.random.key(0)).lower(lowering_platforms=("cpu",)).as_text()


@pytest.mark.skipif(_threefry_cpu._jax_cpu_rule is None, reason="this JAX has no rolled CPU lowering to replace")
def test_the_hash_loop_runs_over_one_flat_axis():
    # what makes the difference to XLA's CPU compile time: the loop's arrays are 1-D (24 = 2 x 3 x 4
    # counters, padded to a multiple of FLAT_MULTIPLE = 16); lowered for the CPU whatever the default
    # backend (on a GPU the lowering is another)
    assert _threefry_cpu.FLAT_MULTIPLE == 16
    text = _cpu_text(lambda k: jax.random.bits(k, (2, 3, 4)))
    loops = [line for line in text.splitlines() if "stablehlo.while" in line]
    assert loops and all("tensor<32xui32>" in line for line in loops)
    assert not any(re.search(r"tensor<2x3x4xui32>", line) for line in loops)
    # above FLAT_MAX_SIZE, JAX's own loop over the array's shape
    n = _threefry_cpu.FLAT_MAX_SIZE // 64 + 1
    text = _cpu_text(lambda k: jax.random.bits(k, (n, 8, 8)))
    assert any(f"tensor<{n}x8x8xui32>" in line for line in text.splitlines() if "stablehlo.while" in line)


def _equations(jaxpr):
    """Every equation of ``jaxpr`` and of the programs nested in it."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _equations(inner)


def test_the_hash_traces_to_plain_primitives():
    # It is traced again at every call site of every program lowered (from the persistent cache
    # too): written with jnp and a closure as its loop body, it held nested jit calls (remainder,
    # where) and a scan, and took about 18 ms a site to trace and lower instead of about 4 ms.
    u32 = jax.ShapeDtypeStruct((31,), np.uint32)
    scalar = jax.ShapeDtypeStruct((), np.uint32)
    closed = jax.make_jaxpr(threefry2x32_20)(scalar, scalar, u32, u32)
    names = [eqn.primitive.name for eqn in _equations(closed.jaxpr)]
    assert names.count("while") == 1
    assert not {"jit", "pjit", "scan"} & set(names)
    assert len(names) < 60
