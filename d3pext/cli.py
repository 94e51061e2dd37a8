"""Command line interface: ``d3pext demo``, ``d3pext epsilon`` and ``d3pext sigma``.

>>> from d3pext.cli import main
>>> main(["epsilon", "--sigma", "2", "--q", "0.01", "--steps", "1000", "--delta", "1e-5"])  # doctest: +ELLIPSIS
epsilon: ...
relation: substitute
0
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Optional, Sequence

__all__ = ["main", "run", "build_parser"]

_RELATIONS = ("substitute", "add_remove")


def _number(kind: str, low: float, high: float, low_open: bool = True, high_open: bool = False):
    """argparse ``type=`` for a float in an interval, with a message naming the allowed range."""
    left, right = "(" if low_open else "[", ")" if high_open else "]"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        above = value > low if low_open else value >= low
        below = value < high if high_open else value <= high
        if not (math.isfinite(value) and above and below):
            allowed = f"> {low:g}" if math.isinf(high) else f"in {left}{low:g}, {high:g}{right}"
            raise argparse.ArgumentTypeError(f"{kind} must be {allowed}, got {text}")
        return value

    return parse


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"seed must be in [0, 2**32), got {text}")
    return value


_positive = _number("value", 0.0, math.inf, high_open=True)
_delta = _number("delta", 0.0, 1.0, high_open=True)
_q = _number("q", 0.0, 1.0)


def _add_accounting_args(p: argparse.ArgumentParser, first: str, first_help: str) -> None:
    p.add_argument(f"--{first}", type=_positive, required=True, help=first_help)
    p.add_argument("--q", type=_q, required=True, help="sampling rate: batch size / number of records, in (0, 1]")
    p.add_argument("--steps", type=_positive_int, required=True, help="number of DP-SGD steps")
    p.add_argument("--delta", type=_delta, required=True, help="delta, in (0, 1)")
    p.add_argument(
        "--relation",
        choices=_RELATIONS,
        default="substitute",
        help="neighbouring relation: 'substitute' (fixed-size batches without replacement, the default) "
        "or 'add_remove' (Poisson batches)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``d3pext`` command.

    >>> from d3pext.cli import build_parser
    >>> args = build_parser().parse_args(["epsilon", "--sigma", "1", "--q", "0.1", "--steps", "10", "--delta", "1e-5"])
    >>> args.sigma, args.relation
    (1.0, 'substitute')
    """
    parser = argparse.ArgumentParser(
        prog="d3pext", description="Bayesian inference under differential privacy for NumPyro."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,epsilon,sigma}")

    demo = sub.add_parser(
        "demo",
        help="fit DP logistic regression on the bundled breast cancer data",
        description="Fit logistic regression with DP-VI (DPSVI) on the bundled breast cancer data at a target "
        "(epsilon, delta), then without privacy at the same settings, and compare test accuracy.",
    )
    demo.add_argument("--epsilon", type=_positive, default=1.0, help="target epsilon (default 1)")
    demo.add_argument(
        "--delta", type=_delta, default=None, help="target delta (default min(1e-5, 0.1/N), below 1/N)"
    )
    demo.add_argument("--steps", type=_positive_int, default=200, help="number of steps (default 200)")
    demo.add_argument("--batch-size", type=_positive_int, default=200, help="records per step (default 200)")
    demo.add_argument("--clip", type=_positive, default=1.0, help="clipping threshold C (default 1)")
    demo.add_argument("--learning-rate", type=_positive, default=0.1, help="Adam learning rate (default 0.1)")
    demo.add_argument("--repeats", type=_positive_int, default=3,
                      help="private runs whose accuracy is summarised (default 3; the data are public)")
    demo.add_argument(
        "--seed",
        type=_seed,
        default=None,
        help="seed for a reproducible run (default: OS entropy for the DP noise and minibatches)",
    )
    demo.set_defaults(handler=_demo, subparser=demo)

    eps = sub.add_parser(
        "epsilon",
        help="epsilon spent by DP-SGD / DP-VI",
        description="The epsilon of the subsampled Gaussian mechanism composed over --steps steps.",
    )
    _add_accounting_args(eps, "sigma", "noise multiplier: noise std is sigma * C on the sum of clipped gradients")
    eps.set_defaults(handler=_epsilon, subparser=eps)

    sig = sub.add_parser(
        "sigma",
        help="noise multiplier for a target (epsilon, delta)",
        description="The smallest noise multiplier sigma whose epsilon after --steps steps is at most --epsilon.",
    )
    _add_accounting_args(sig, "epsilon", "target epsilon")
    sig.add_argument("--time-limit", type=_positive, default=2.0,
                     help="seconds of CPU time after which the search gives up with the reason (default 2)")
    sig.set_defaults(handler=_sigma, subparser=sig)

    audit = sub.add_parser(
        "audit",
        help="empirical privacy audit of the release mechanisms (lower bound on epsilon)",
        description="Draws many releases of two neighbouring inputs and reports a Clopper-Pearson "
        "lower bound on each mechanism's epsilon next to its claim (d3pext.audit).",
    )
    audit.add_argument("--epsilon", type=float, default=1.0, help="the mechanisms' epsilon (default 1)")
    audit.add_argument("--delta", type=float, default=1e-5, help="the Gaussian mechanism's delta")
    audit.add_argument("--releases", type=int, default=20_000, help="releases per input (default 20000)")
    audit.add_argument("--seed", type=int, default=None, help="seed of the audit (default: OS entropy)")
    audit.add_argument("--controls", action="store_true",
                       help="also audit a deliberately broken control (the naive float32 Laplace), which must be flagged")
    audit.set_defaults(handler=_audit, subparser=audit)
    return parser


def _use_compile_cache() -> None:
    """Reuse compiled programs across runs (``D3PEXT_NO_COMPILE_CACHE=1`` opts out; see d3pext.compile_cache)."""
    from d3pext.compile_cache import enable_compile_cache

    enable_compile_cache()


def _audit(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    _use_compile_cache()
    from d3pext.audit import NaiveFloatLaplace, audit_mechanism, audit_report
    from d3pext.releases.mechanisms import GaussianMechanism, GeometricMechanism, LaplaceMechanism

    try:
        mechanisms = [
            (LaplaceMechanism(args.epsilon, sensitivity=1.0), 0.0, 1.0),
            (LaplaceMechanism(args.epsilon, sensitivity=1.0), 0.0, 0.1),
            (GaussianMechanism(args.epsilon, args.delta, sensitivity=1.0), 0.0, 1.0),
            (GeometricMechanism(args.epsilon), 0, 1),
        ] + ([(NaiveFloatLaplace(args.epsilon), 0.1, 1.1)] if args.controls else [])
        results = [
            audit_mechanism(m, x0, x1, num_releases=args.releases,
                            rng_key=None if args.seed is None else args.seed + i,
                            name=f"{type(m).__name__} ({x0} vs {x1})")
            for i, (m, x0, x1) in enumerate(mechanisms)
        ]
    except ValueError as e:
        parser.error(str(e))
    print(audit_report(results))
    shipped = [r for r in results if not r.name.startswith("NaiveFloatLaplace")]
    bad = [r.name for r in shipped if r.violates_claim]
    print("verdict:", "VIOLATION in " + ", ".join(bad) if bad else "no shipped mechanism leaks more than it claims")
    if args.controls:
        caught = all(r.violates_claim for r in results if r not in shipped)
        print("control:", "the broken control was flagged" if caught else "the broken control was NOT flagged: "
              "use more --releases")


def _epsilon(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    from d3pext import accountants

    try:
        eps = accountants.epsilon(args.sigma, args.q, args.steps, args.delta, args.relation)
    except (accountants.AccountingError, ValueError) as e:
        parser.error(str(e))
    print(f"epsilon: {float(eps):.6g}")
    _print_settings(sigma=args.sigma, delta=args.delta, q=args.q, steps=args.steps, relation=args.relation)


def _sigma(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    import signal
    import threading

    from d3pext import accountants

    def out_of_time(signum, frame):
        raise TimeoutError

    # A CPU-time limit (SIGPROF), where signals can be used: the main thread of a POSIX process.
    limit = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGPROF, out_of_time) if limit else None
    try:
        if limit:
            signal.setitimer(signal.ITIMER_PROF, args.time_limit)
        result = accountants.approximate_sigma(args.epsilon, args.delta, args.q, args.steps, args.relation)
    except (accountants.AccountingError, ValueError) as e:
        parser.error(str(e))
    except TimeoutError:
        parser.error(
            f"no sigma was certified within {args.time_limit:g} s of CPU time (--time-limit): at these settings "
            "the Fourier accountant cannot resolve delta (typically a delta below about 1e-9 with a sampling "
            "rate below 1e-4, where FFT rounding noise reaches delta) and its dp-accounting fallback takes "
            "minutes; use a larger delta or a larger --time-limit"
        )
    finally:
        if limit:
            signal.setitimer(signal.ITIMER_PROF, 0)
            signal.signal(signal.SIGPROF, previous)
    print(f"sigma: {float(result.sigma):.6g}")
    print(f"epsilon: {float(result.epsilon):.6g} (target {args.epsilon:g})")
    _print_settings(delta=args.delta, q=args.q, steps=args.steps, relation=args.relation)


def _print_settings(**fields) -> None:
    for name, value in fields.items():
        print(f"{name}: {value:g}" if isinstance(value, float) else f"{name}: {value}")


def _run_demo(
    data, *, epsilon: float, delta: Optional[float], steps: int, batch_size: int, clip: float,
    learning_rate: float, seed: Optional[int], repeats: int = 1, progress_bar: bool = False,
    freeze_imports: bool = False,
) -> dict:
    """Fit logistic regression to ``data`` (a :class:`~d3pext.datasets.TrainTestSplit`) with DPSVI
    (``repeats`` independent runs, which compile once) and SVI.

    ``freeze_imports`` (for the command's own short process) leaves the objects created so far, most
    of them the imported modules of JAX, NumPyro and SciPy, out of the garbage collector's later
    scans (:func:`gc.freeze`) and turns collection back on (the command turns it off while they are
    imported): a warm demo spent 0.25 s in collections, mostly full ones over them."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import numpyro
    from numpyro.infer import SVI, Trace_ELBO, TraceMeanField_ELBO

    from d3pext import DPSVI
    from d3pext.compile_cache import cached_jit
    from d3pext.models import logistic_guide, logistic_regression

    if freeze_imports:
        import gc

        gc.freeze()
        gc.enable()

    def with_intercept(x):
        return np.hstack([x, np.ones((len(x), 1), np.float32)])

    # device_put, not jnp.asarray: in a fresh process every eager jnp call compiles a small program
    x_train = jax.device_put(with_intercept(data.x_train))
    y_train = jax.device_put(np.asarray(data.y_train, np.float32))
    x_test = with_intercept(data.x_test)

    def accuracy(params) -> float:
        return float(np.mean((x_test @ np.asarray(params["w_loc"]) > 0) == (data.y_test == 1)))

    # Keys made on the host (numpy's SeedSequence, then wrapped): eager jax.random calls each compile a
    # small program in every new process, a tenth of a warm demo's time.
    def host_key(seq) -> jax.Array:
        return jax.random.wrap_key_data(seq.generate_state(2, np.uint32), impl="threefry2x32")

    if seed is None:
        dp_keys = [None] * repeats  # DPSVI draws its keys from OS entropy
        plain_key = host_key(np.random.SeedSequence())
    else:
        plain_seq, *dp_seqs = np.random.SeedSequence(seed).spawn(repeats + 1)
        dp_keys, plain_key = [host_key(seq) for seq in dp_seqs], host_key(plain_seq)
    optim = numpyro.optim.Adam(learning_rate)
    start = time.perf_counter()
    dpsvi = DPSVI(logistic_regression, logistic_guide, optim, Trace_ELBO(), clipping_threshold=clip,
                  epsilon=epsilon, delta=delta, num_steps=steps)  # fmt: skip
    runs = [
        dpsvi.run(key, steps, x_train, y_train, batch_size=batch_size, progress_bar=progress_bar and i == 0)
        for i, key in enumerate(dp_keys)
    ]
    private = runs[0]
    dp_seconds = time.perf_counter() - start
    start = time.perf_counter()
    # TraceMeanField_ELBO (the same objective, its Gaussian KL in closed form): Trace_ELBO sums its site
    # terms in the order of a Python set, which changes with the process's string hashing, so its
    # program (and its compile-cache entry) changed from one run to the next
    plain_svi = SVI(logistic_regression, logistic_guide, optim, TraceMeanField_ELBO())
    # one compiled program for init and steps (one cache entry) instead of NumPyro's eager init
    plain = cached_jit(lambda key, x, y: plain_svi.run(key, steps, x, y, batch_size=batch_size, progress_bar=False))(
        plain_key, x_train, y_train
    )
    plain_seconds = time.perf_counter() - start
    return {
        "privacy": private.privacy,
        "dp_params": private.params,
        "plain_params": plain.params,
        "dp_accuracy": accuracy(private.params),
        "dp_accuracies": [accuracy(run.params) for run in runs],
        "plain_accuracy": accuracy(plain.params),
        "dp_seconds": dp_seconds,
        "plain_seconds": plain_seconds,
    }


def _demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    import gc

    gc.disable()  # while JAX, NumPyro and SciPy are imported: their objects live as long as the process
    try:
        _fit_demo(args, parser)
    finally:
        gc.enable()


def _fit_demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    _use_compile_cache()
    from d3pext.accountants import AccountingError
    from d3pext.datasets import load_breast_cancer

    data = load_breast_cancer()
    n, num_features = data.x_train.shape
    if args.batch_size > n:
        parser.error(
            f"argument --batch-size: must be at most the number of training records ({n}), got {args.batch_size}"
        )
    if args.delta is not None and args.delta >= 1.0 / n:
        print(f"warning: delta={args.delta:g} is not below 1/N = {1.0 / n:.3g}", file=sys.stderr)
    try:
        print(f"fitting {args.repeats} private run(s) and a non-private one; the first compiles (5-15 s on a CPU "
              "the first time, less once the compile cache is warm)...", file=sys.stderr, flush=True)
        fit = _run_demo(
            data, epsilon=args.epsilon, delta=args.delta, steps=args.steps, batch_size=args.batch_size,
            clip=args.clip, learning_rate=args.learning_rate, seed=args.seed, repeats=args.repeats,
            progress_bar=sys.stderr.isatty(), freeze_imports=True,
        )  # fmt: skip
    except (AccountingError, ValueError) as e:
        parser.error(str(e))
    report = fit["privacy"]
    randomness = "OS entropy" if args.seed is None else f"seed {args.seed} (reproducible: for testing only)"
    print("data: Breast Cancer Wisconsin (Diagnostic), UCI, CC BY 4.0")
    print(f"records: {n} train, {len(data.x_test)} test, {num_features} features + intercept")
    print("scaling: fixed public per-feature bounds to [-1, 1] (declared constants, not computed from the records)")
    print(f"epsilon: {report.epsilon:.4g} (target {args.epsilon:g})")
    print(f"delta: {report.delta:.3g}")
    print(f"sigma: {report.noise_multiplier:.4g} (noise multiplier: each step adds Gaussian noise of sd "
          "sigma x C to the sum of the batch's clipped per-record gradients)")
    print(f"clipping threshold: {report.clipping_threshold:g} (C: each record's gradient is scaled down to norm <= C)")
    print(f"q: {report.sampling_rate:.4g} (sampling rate: the share of records in each step's batch, {args.batch_size} "
          f"of {n})")
    print(f"steps: {report.num_steps}")
    print(f"relation: {report.relation} ({report.sampler}: neighbouring data sets differ in one record replaced by "
          "another; add/remove accounting, which other libraries print, gives a smaller epsilon for the same run)")
    print(f"randomness: {randomness}")
    print(f"test accuracy DP: {fit['dp_accuracy']:.3f} ({fit['dp_seconds']:.1f} s)")
    accuracies = fit["dp_accuracies"]
    if len(accuracies) > 1:
        import statistics

        print(f"test accuracy DP over {len(accuracies)} runs: mean {statistics.mean(accuracies):.3f}, sd "
              f"{statistics.stdev(accuracies):.3f} (single private runs vary; the data are public, so repeating "
              "is harmless here, but each run on confidential data would spend the epsilon above again)")
    print(f"test accuracy non-private: {fit['plain_accuracy']:.3f} ({fit['plain_seconds']:.1f} s)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the ``d3pext`` command with ``argv`` (default: ``sys.argv[1:]``); returns the exit status.

    Bad input exits through argparse (status 2, a usage line and the message on stderr).

    >>> from d3pext.cli import main
    >>> main(["sigma", "--epsilon", "1", "--q", "0.01", "--steps", "1000", "--delta", "1e-5"])  # doctest: +ELLIPSIS
    sigma: ...
    relation: substitute
    0
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    args.handler(args, args.subparser)
    return 0


def run(argv: Optional[Sequence[str]] = None) -> None:
    """The ``d3pext`` script and ``python -m d3pext``: :func:`main`, then exit with its status.

    After a command has finished, the process exits without Python's teardown: freeing the modules
    of JAX, NumPyro and SciPy one by one takes 0.3-0.4 s, longer than a warm ``d3pext sigma``. Output
    is flushed first and nothing else of this command is pending (every result has been printed).
    Errors (a bad argument, an exception) exit the usual way. Call :func:`main` to stay in the process.
    """
    status = main(argv)
    import logging

    logging.shutdown()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(status)
