"""d3pext's program store (d3pext.compile_cache.compile_traced): executables kept by traced program,
read back without lowering, never for another program."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from d3pext import compile_cache
from d3pext.compile_cache import cached_jit


@pytest.fixture
def store(tmp_path, monkeypatch):
    directory = tmp_path / compile_cache.PROGRAMS_SUBDIR
    monkeypatch.setattr(compile_cache, "_programs_dir", directory)
    return directory


def entries(directory):
    return sorted(p.name for p in directory.glob("*.xla")) if directory.exists() else []


@pytest.fixture
def no_lowering(monkeypatch):
    """Fail any lowering from now on: a program must come from the store."""

    def refuse(*args, **kwargs):
        raise AssertionError("lowered, although the program was stored")

    def install():
        monkeypatch.setattr(jax.stages.Traced, "lower", refuse)

    return install


def affine(x, key):
    return jnp.sin(x) * 2.0 + jnp.arange(3.0), jax.random.normal(key, (2,))


def test_a_stored_program_is_read_back_without_lowering_and_gives_the_same_results(store, no_lowering):
    x, key = jnp.linspace(0.0, 1.0, 3), jax.random.key(1)
    first = cached_jit(affine)(x, key)
    assert len(entries(store)) == 1
    no_lowering()
    fn = cached_jit(affine)  # a new object, as in a new process: nothing in memory
    again = fn(x, key)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert len(entries(store)) == 1
    fn(x + 1.0, jax.random.key(2))
    assert fn._cache_size() == 1  # the same types: the same executable


def test_a_stored_program_is_not_also_written_to_jax_s_cache(store):
    cache_dir = jax.config.jax_compilation_cache_dir
    assert cache_dir  # the test process keeps a cache of its own (conftest)

    def new_entries(before):
        return [name for name in set(os.listdir(cache_dir)) - before if name.endswith("-cache")]

    previous = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    try:
        x = jnp.ones(5)  # (op by op: an entry of its own)
        before = set(os.listdir(cache_dir))
        cached_jit(lambda v: jnp.tanh(v) * 3.0)(x)
        assert len(entries(store)) == 1 and new_entries(before) == []
        jax.jit(lambda v: jnp.tanh(v) * 4.0)(x)  # JAX itself does write here
        assert new_entries(before)
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", previous)


def test_every_change_to_the_program_or_its_types_is_another_entry(store):
    x = jnp.ones(3)
    scale = {"value": 2.0}
    table = {"value": np.arange(3.0, dtype=np.float32)}

    def program():  # a new function each time, as in a new process (JAX keeps traces per function)
        return cached_jit(lambda x: x * scale["value"] + table["value"])

    program()(x)
    assert len(entries(store)) == 1
    scale["value"] = 3.0  # a literal of the program (a global read while tracing)
    np.testing.assert_allclose(program()(x), 3.0 + np.arange(3.0))
    table["value"] = np.arange(3.0, dtype=np.float32) + 1.0  # a constant array: same text, other values
    np.testing.assert_allclose(program()(x), 4.0 + np.arange(3.0))
    program()(jnp.ones((2, 3)))  # another shape
    program()(np.float32(1.0))  # a strongly typed scalar ...
    program()(1.0)  # ... and a weakly typed one
    assert len(entries(store)) == 6
    with jax.default_matmul_precision("highest"):  # the configuration, also inside a with block
        program()(x)
    assert len(entries(store)) == 7


def test_jit_options_are_part_of_the_program(store):
    """A donating executable was served to a later ``cached_jit`` that asked for no donation: the
    caller's argument was deleted ("Array has been deleted")."""
    def f(x):
        return jnp.sin(x) * 2.0

    cached_jit(f, donate_argnums=0)(jnp.arange(4.0))
    x = jnp.arange(4.0)
    np.testing.assert_allclose(cached_jit(f)(x), np.sin(np.arange(4.0)) * 2.0, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(x), np.arange(4.0))  # still there
    assert len(entries(store)) == 2
    cached_jit(f, keep_unused=True)(x)
    assert len(entries(store)) == 3


def test_a_damaged_entry_is_compiled_again_and_replaced(store):
    x = jnp.ones(3)
    expected = np.asarray(cached_jit(jnp.cos)(x))
    (path,) = store.glob("*.xla")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    np.testing.assert_array_equal(np.asarray(cached_jit(jnp.cos)(x)), expected)
    assert path.read_bytes() != bytes(data)  # written whole again


def test_programs_with_host_callbacks_are_not_stored(store):
    def fn(x):
        return jax.pure_callback(lambda v: np.asarray(v) + 1.0, jax.ShapeDtypeStruct((3,), jnp.float32), x)

    np.testing.assert_allclose(cached_jit(fn)(jnp.ones(3)), 2.0)
    assert entries(store) == []


def test_an_executable_read_from_jax_s_cache_is_compiled_again_before_it_is_stored(store, monkeypatch):
    # on a CPU an executable that JAX read from its cache serialises without its kernels and fails when
    # run in the next process: after a hit the program is compiled again under another JAX key, and
    # stored only if that one is built afresh
    real = jax.stages.Lowered.compile
    options = []

    def hit_unless_again(self, compiler_options=None, **kwargs):
        options.append(compiler_options)
        if compiler_options is None or hits_always:
            jax.monitoring.record_event("/jax/compilation_cache/cache_hits")
        return real(self, compiler_options=compiler_options, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", hit_unless_again)
    hits_always = True
    np.testing.assert_allclose(cached_jit(jnp.exp)(jnp.zeros(2)), 1.0)
    assert entries(store) == [] and options == [None, compile_cache._AGAIN]
    hits_always = False
    np.testing.assert_allclose(cached_jit(jnp.exp)(jnp.zeros(3)), 1.0)
    assert len(entries(store)) == 1


def test_the_store_drops_its_least_recently_used_entries_beyond_its_size(store, monkeypatch):
    x = jnp.ones(3)
    cached_jit(jnp.sin)(x)
    (oldest,) = store.glob("*.xla")
    os.utime(oldest, (1.0, 1.0))
    monkeypatch.setattr(compile_cache, "PROGRAMS_MAX_SIZE", 1)  # the newest entry stays, whatever its size
    cached_jit(jnp.cos)(x)
    assert len(entries(store)) == 1 and not oldest.exists()


def test_a_configuration_block_is_another_program_also_in_memory(store):
    a, b = jnp.full((2, 2), 1.0 + 2.0**-10), jnp.full((2, 2), 1.0 + 2.0**-10)
    matmul = cached_jit(jnp.matmul)
    with jax.default_matmul_precision("highest"):
        exact = np.asarray(matmul(a, b))
    np.testing.assert_array_equal(np.asarray(jax.jit(jnp.matmul)(a, b)), np.asarray(matmul(a, b)))
    with jax.default_matmul_precision("highest"):
        np.testing.assert_array_equal(np.asarray(matmul(a, b)), exact)
    assert len(entries(store)) == 2


def test_inside_a_trace_and_on_another_device_it_is_jax_jit(store):
    double = cached_jit(lambda v: 2.0 * v)
    np.testing.assert_allclose(jax.jit(double)(jnp.ones(2)), 2.0)  # tracers: the plain jit
    np.testing.assert_allclose(jax.grad(lambda v: double(v).sum())(jnp.ones(2)), 2.0)
    assert entries(store) == []
    devices = jax.devices()
    if len(devices) > 1:
        np.testing.assert_allclose(double(jax.device_put(jnp.ones(2), devices[1])), 2.0)
        assert entries(store) == []


def test_a_program_that_cannot_be_serialised_or_written_still_runs(store, monkeypatch):
    from jax.experimental import serialize_executable

    def refuse(compiled):
        raise NotImplementedError("serialize_executables with const_args")

    monkeypatch.setattr(serialize_executable, "serialize", refuse)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not worth a warning: such a program is simply not kept
        np.testing.assert_allclose(cached_jit(jnp.sinh)(jnp.zeros(2)), 0.0)
    assert entries(store) == []
    monkeypatch.undo()
    monkeypatch.setattr(compile_cache, "_programs_dir", store)

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(compile_cache, "_store", full_disk)  # a write that fails: a warning, and the result
    with pytest.warns(RuntimeWarning, match="could not store a compiled program.*No space left"):
        np.testing.assert_allclose(cached_jit(jnp.cosh)(jnp.zeros(2)), 1.0)


def test_the_store_is_off_unless_the_compile_cache_is_enabled(tmp_path, monkeypatch):
    monkeypatch.setattr(compile_cache, "_programs_dir", None)
    np.testing.assert_allclose(cached_jit(jnp.tanh)(jnp.zeros(2)), 0.0)
    assert not list(tmp_path.iterdir())


_DEMO = """
import sys, json
import d3pext
from d3pext.cli import _run_demo
from d3pext.datasets import load_breast_cancer
from jax import monitoring
lowered = []
monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kw: lowered.append(1) if event.endswith("jaxpr_to_mlir_module_duration") else None)
d3pext.enable_compile_cache(sys.argv[1], min_compile_time_secs=0.0)
fit = _run_demo(load_breast_cancer(), epsilon=1.0, delta=None, steps=3, batch_size=50, clip=1.0, learning_rate=0.05,
                seed=0)
print(json.dumps({"lowered": len(lowered), "dp": [float(v) for v in fit["dp_params"]["w_loc"]],
                  "plain": [float(v) for v in fit["plain_params"]["w_loc"]]}))
"""


def test_a_second_demo_process_lowers_nothing_and_fits_the_same(tmp_path):
    # the programs of DPSVI (init, record-isolation check, steps) and the demo's non-private fit are
    # read back from the store: the new process traces them (for the key) but lowers none
    import json

    def run(hash_seed):
        env = {**os.environ, "PYTHONHASHSEED": str(hash_seed), "JAX_PLATFORMS": "cpu"}
        env = {k: v for k, v in env.items() if not k.startswith("D3PEXT_")}
        proc = subprocess.run([sys.executable, "-c", _DEMO, str(tmp_path)], env=env, check=True, timeout=300,
                              capture_output=True, text=True)  # fmt: skip
        return json.loads(proc.stdout.strip().splitlines()[-1])

    first = run(1)
    stored = entries(tmp_path / compile_cache.PROGRAMS_SUBDIR)
    assert len(stored) == 4, stored
    second = run(3)
    assert second["lowered"] == 0 and first["lowered"] >= 4
    assert entries(tmp_path / compile_cache.PROGRAMS_SUBDIR) == stored
    assert second["dp"] == first["dp"] and second["plain"] == first["plain"]


_SMALL = """
import sys, jax, jax.numpy as jnp
import d3pext
from d3pext.compile_cache import cached_jit
if sys.argv[2] == "jax-only":  # JAX's cache alone, as before d3pext kept programs
    jax.config.update("jax_compilation_cache_dir", sys.argv[1])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
else:
    d3pext.enable_compile_cache(sys.argv[1], min_compile_time_secs=0.0)
fn = cached_jit(lambda x, key: jnp.cumsum(jnp.sin(x)) + jax.random.normal(key, x.shape))
print(fn(jnp.linspace(0.0, 1.0, 5), jax.random.key(0)).tolist())
"""


def test_programs_already_in_jax_s_cache_are_stored_whole_and_run_in_the_next_process(tmp_path):
    def run(mode):
        env = {k: v for k, v in os.environ.items() if not k.startswith("D3PEXT_")}
        proc = subprocess.run([sys.executable, "-c", _SMALL, str(tmp_path), mode], env={**env, "JAX_PLATFORMS": "cpu"},
                              check=True, timeout=120, capture_output=True, text=True)  # fmt: skip
        return proc.stdout.strip()

    expected = run("jax-only")
    assert entries(tmp_path / compile_cache.PROGRAMS_SUBDIR) == []
    assert run("store") == expected  # JAX's cache hits: compiled once more, afresh, and stored
    assert len(entries(tmp_path / compile_cache.PROGRAMS_SUBDIR)) == 1
    assert run("store") == expected  # read back from the store, and it runs
