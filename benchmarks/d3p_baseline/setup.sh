#!/usr/bin/env bash
# Creates (or verifies) the separate virtual environment for the d3p 0.2.0 baseline:
#   benchmarks/.d3p-env   (git-ignored)
# with the pinned versions in benchmarks/d3p_baseline/requirements.txt.
#
# Idempotent: when the environment already imports d3p with the pinned JAX versions it
# does nothing. `--force` deletes and rebuilds it. D3P_PYTHON selects the interpreter
# (default: python3.11; the pins need CPython 3.11 on x86_64 Linux).
#
# Usage:  bash benchmarks/d3p_baseline/setup.sh [--force]
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ENV_DIR="$(cd "$HERE/.." && pwd)/.d3p-env"
REQS="$HERE/requirements.txt"
PY="${D3P_PYTHON:-python3.11}"

check_env() {
    [ -x "$ENV_DIR/bin/python" ] || return 1
    "$ENV_DIR/bin/python" - "$REQS" <<'PYEOF' >/dev/null 2>&1
import sys
from importlib.metadata import version
pins = {}
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if line:
        name, v = line.split("==")
        pins[name] = v
for name in ("d3p", "jax", "jaxlib", "jax-chacha-prng", "numpyro"):
    assert version(name) == pins[name], (name, version(name), pins[name])
import d3p.random, d3p.svi, d3p.minibatch, d3p.dputil  # noqa: F401  (imports jax-chacha-prng)
import jax.numpy as jnp
k = d3p.random.PRNGKey(0)
assert d3p.random.normal(k, (2,)).shape == (2,)
PYEOF
}

if [ "${1:-}" = "--force" ]; then
    rm -rf "$ENV_DIR"
fi

if check_env; then
    echo "d3p baseline environment OK: $ENV_DIR"
    exit 0
fi

if ! command -v "$PY" >/dev/null 2>&1; then
    echo "error: $PY not found; set D3P_PYTHON to a CPython 3.11 interpreter" >&2
    exit 1
fi
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' || {
    echo "error: $PY is not CPython 3.11 (the pinned jaxlib 0.4.25 / jax-chacha-prng wheels are cp311)" >&2
    exit 1
}

echo "creating d3p baseline environment in $ENV_DIR"
rm -rf "$ENV_DIR"
"$PY" -m venv "$ENV_DIR"
"$ENV_DIR/bin/python" -m pip install --quiet --upgrade pip
"$ENV_DIR/bin/python" -m pip install --quiet --no-deps -r "$REQS"
"$ENV_DIR/bin/python" -m pip check

if check_env; then
    "$ENV_DIR/bin/python" -c 'import jax, jaxlib, numpyro, d3p.version as v; print("d3p", v.VERSION, "jax", jax.__version__, "jaxlib", jaxlib.__version__, "numpyro", numpyro.__version__)' 2>/dev/null \
        || "$ENV_DIR/bin/python" -c 'import jax, jaxlib, numpyro; print("jax", jax.__version__, "jaxlib", jaxlib.__version__, "numpyro", numpyro.__version__)'
    echo "d3p baseline environment ready: $ENV_DIR"
else
    echo "error: environment created but d3p does not import; see the pins in $REQS" >&2
    exit 1
fi
