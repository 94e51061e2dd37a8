#!/usr/bin/env bash
# The GPU rows of RESULTS.md in one call, each benchmark with its own time limit and log.
#
#   bash benchmarks/gpu.sh [OUT_DIR]          # on a machine with a GPU and JAX's CUDA plugin
#   SMALL=1 bash benchmarks/gpu.sh /tmp/out   # the same steps at toy sizes (checks the script on a CPU)
#   TESTS=1 bash benchmarks/gpu.sh /tmp/out   # instead: the default test set on the GPU (about 4 min on an H100)
#   TESTS=slow bash benchmarks/gpu.sh /tmp/out   # instead: the slow tests of the exact samplers on the GPU
#                                                # (subnormals and signed zeros differ there: session 14)
#
# Needs the project importable (pip install -e .); where packages are missing, wheels in .whl/ are
# installed into /tmp/site first (numpyro, fourier-accountant, dp-accounting, flowjax and their pure
# Python needs). Each benchmark runs alone, one after the other, so that none shares the GPU.
set -u
out=${1:-${OUT:-/tmp/gpu-bench}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c "import d3pext.handlers" 2>/dev/null \
    || python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$out/install.log" 2>&1
python3 - <<'EOF' 2>&1 | tee "$out/env.log"
import jax, numpyro, d3pext, platform, os
print(f"jax {jax.__version__}, numpyro {numpyro.__version__}, d3pext {d3pext.__version__}, "
      f"{jax.devices()}, {os.cpu_count()} CPUs ({platform.processor() or platform.machine()})")
EOF

step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2; shift 2
    echo "=== $name (limit ${limit}s): $*" | tee "$out/$name.log"
    local t0=$SECONDS
    timeout "$limit" "$@" >>"$out/$name.log" 2>&1
    echo "=== $name: exit $? after $((SECONDS - t0)) s" | tee -a "$out/$name.log"
    grep -v "^===" "$out/$name.log" | tail -n 40
}

if [ "${TESTS:-}" = slow ]; then
    # the samplers' statistical and exactness checks (slow-marked) on the GPU, 12 workers, one test at a time
    step slow_tests 450 python3 -m pytest -q -n 12 -p no:cacheprovider --junitxml="$out/gpu_slow_tests.xml" \
        tests/test_bessel.py tests/test_counts.py tests/test_tgm.py tests/test_bounded.py tests/test_distributions.py \
        tests/test_regression.py tests/test_expfam.py tests/test_accelerator_forms.py tests/test_handlers.py \
        -o addopts="-m slow --dist load -p no:benchmark -p no:hypothesispytest"
    exit 0
fi
if [ -n "${TESTS:-}" ]; then
    # The default test set on the GPU (xdist, 12 workers), less the files that need packages a bare GPU
    # image lacks (docs, notebooks, ArviZ) and the host-only accountant; JUnit XML in OUT_DIR
    step tests 400 python3 -m pytest -q -n 12 -p no:cacheprovider --junitxml="$out/gpu_tests.xml" \
        --ignore tests/test_docs.py --ignore tests/test_notebooks.py --ignore tests/test_arviz.py \
        --ignore tests/test_accountants.py -o addopts="-m 'not slow' --dist loadfile -p no:benchmark -p no:hypothesispytest"
    exit 0
fi

if [ -n "${SMALL:-}" ]; then
    step bounded 600 python3 benchmarks/bench_bounded.py --small --chains 2,20 --skip kernel releases
    step dpsvi 600 python3 benchmarks/bench_dpsvi.py --quick --no-d3p --no-vae
    step expfam 600 python3 benchmarks/bench_expfam.py --chains 4 --releases 4 --iters 200 --numpy-iters 400 --numpy-chains 4
    step sppe 600 python3 benchmarks/bench_sbi.py --methods sppe --skip-slopes --rounds 2 --sims 200 --num-points 4 --layers 2 --width 8
else
    # Kazan & Reiter Gibbs against the NumPy single chain (target: 100x at 1000 chains)
    step bounded 150 python3 benchmarks/bench_bounded.py --chains 1,100,1000,10000 --skip kernel
    # DP-VI step: NumPyro SVI vs DPSVI, logistic regression and the VAE
    step dpsvi 75 python3 benchmarks/bench_dpsvi.py --quick --no-d3p
    # Bernstein & Sheldon beta-binomial Gibbs, many releases x chains
    step expfam 40 python3 benchmarks/bench_expfam.py --chains 100 --releases 100 --iters 2000 --numpy-iters 20000 --numpy-chains 20
    # SPPE at the paper's size, 10 rounds x 1000 simulations (target on CPU: 5 min)
    step sppe 150 python3 benchmarks/bench_sbi.py --methods sppe --skip-slopes
fi
