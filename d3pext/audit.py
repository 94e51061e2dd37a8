"""Empirical privacy audits: a statistical lower bound on what a mechanism really leaks.

:func:`audit_mechanism` treats a mechanism as a black box. It draws many releases of two
neighbouring inputs ``x0`` and ``x1`` and looks for an event ``S`` that is much more likely under
one than under the other: for an (epsilon, delta)-DP mechanism every event satisfies
``P0(S) <= e^epsilon P1(S) + delta``, so a lower confidence bound on ``P0(S)`` and an upper one on
``P1(S)`` give ``epsilon >= log((P0(S) - delta) / P1(S))`` (the hypothesis-testing audit of
Jagielski, Ullman & Oprea 2020 and Nasr et al. 2021).

The releases of each input are split in two halves. On the *selection* half every test of a
family is scored and the one with the largest apparent epsilon (and its direction) is chosen; on
the *evaluation* half only that test is counted, with Clopper-Pearson intervals (Bonferroni over
the two proportions). The bound therefore holds with the stated confidence whatever the family.
The family:

- ``threshold``: ``y > tau`` for quantiles ``tau`` of the pooled selection releases;
- ``bits<=k``: the exact difference ``y - x_j`` needs at most ``k`` significant bits (computed in
  float64, exact for float32 releases): the lattice of Mironov's (2012) floating-point attack;
- ``lowbits[k]``: the ``k`` low-order bits of the release's float pattern fall in a set chosen on
  the selection half;
- ``value-set``: the release equals a value seen under ``x0`` in the selection half (discrete and
  grid outputs).

>>> from d3pext.releases.mechanisms import LaplaceMechanism
>>> result = audit_mechanism(LaplaceMechanism(1.0, sensitivity=1.0), 0.0, 1.0,
...                          num_releases=4000, rng_key=0)
>>> result.epsilon_lower_bound <= 1.0
True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
import math
from typing import Any, Optional

import numpy as np
from scipy import stats

import jax
import jax.numpy as jnp

from d3pext.prng import secure_key

__all__ = ["AuditResult", "NaiveFloatLaplace", "audit_dpsvi", "audit_mechanism", "audit_report", "one_run_epsilon_bound"]


@dataclass(frozen=True)
class AuditResult:
    """The outcome of :func:`audit_mechanism`.

    :param name: what was audited.
    :param claimed_epsilon: the epsilon the mechanism states (``None`` if unknown).
    :param epsilon_lower_bound: the empirical lower bound (0 when no test distinguishes).
    :param test: the distinguishing test chosen on the selection half.
    :param p0, p1: the test's frequencies under ``x0`` and ``x1`` on the evaluation half.
    :param num_releases: releases per input (both halves).
    :param confidence: confidence of the bound.
    """

    name: str
    claimed_epsilon: Optional[float]
    epsilon_lower_bound: float
    test: str
    p0: float
    p1: float
    num_releases: int
    confidence: float

    @property
    def violates_claim(self) -> bool:
        """Whether the bound shows that the mechanism leaks more than it claims."""
        return self.claimed_epsilon is not None and self.epsilon_lower_bound > self.claimed_epsilon

    def __str__(self) -> str:
        claim = "?" if self.claimed_epsilon is None else f"{self.claimed_epsilon:.4g}"
        verdict = "VIOLATES its claim" if self.violates_claim else "consistent with its claim"
        return (
            f"{self.name}: claimed epsilon {claim}, empirical lower bound "
            f"{self.epsilon_lower_bound:.3f} ({self.confidence:.0%} confidence, test {self.test}, "
            f"{self.num_releases} releases per input): {verdict}"
        )


@dataclass(frozen=True)
class NaiveFloatLaplace:
    """A deliberately broken control: the textbook float32 Laplace mechanism
    ``value + (sensitivity / epsilon) * (E0 - E1)``, which Mironov (2012, "On significance of the
    least significant bits for differential privacy") showed to leak its input through the
    floating-point pattern of its output. An audit should flag it; d3pext never releases this way.

    >>> release = NaiveFloatLaplace(1.0)
    >>> result = audit_mechanism(release, 0.1, 1.1, num_releases=20_000, rng_key=0)
    >>> result.claimed_epsilon, result.test.startswith("bits")
    (1.0, True)
    """

    epsilon: float
    sensitivity: float = 1.0

    def __call__(self, key: jax.Array, value: jax.Array) -> jax.Array:
        k0, k1 = jax.random.split(key)
        noise = jax.random.exponential(k0, (), jnp.float32) - jax.random.exponential(k1, (), jnp.float32)
        return jnp.asarray(value, jnp.float32) + jnp.float32(self.sensitivity / self.epsilon) * noise


def _releases(release: Any, key: jax.Array, value: float, num: int) -> np.ndarray:
    if hasattr(release, "release_many"):
        return np.asarray(release.release_many(key, value, num, reproducible=True))
    keys = jax.random.split(key, num)
    return np.asarray(jax.vmap(lambda k: release(k, jnp.asarray(value)))(keys))


def _significant_bits(d: np.ndarray) -> np.ndarray:
    """Bits between the leading and the lowest set bit of each float64 (0 for zero)."""
    mantissa, _ = np.frexp(np.abs(d))
    bits = np.zeros(d.shape, dtype=np.int64)
    m = (mantissa * 2.0**53).astype(np.int64)
    nonzero = m != 0
    trailing = np.zeros(d.shape, dtype=np.int64)
    rest = np.where(nonzero, m, 1)
    while True:
        even = (rest & 1) == 0
        if not even.any():
            break
        trailing += even
        rest = np.where(even, rest >> 1, rest)
    bits[nonzero] = 53 - trailing[nonzero]
    return bits


def _low_bits(y: np.ndarray, k: int) -> np.ndarray:
    if y.dtype == np.float32:
        return y.view(np.uint32).astype(np.int64) & ((1 << k) - 1)
    if y.dtype == np.float64:
        return (y.view(np.uint64) & np.uint64((1 << k) - 1)).astype(np.int64)
    return y.astype(np.int64) & ((1 << k) - 1)


def _features(y: np.ndarray, x0: float, x1: float, sel0: np.ndarray, sel1: np.ndarray):
    """Each test as ``(name, indicator function)``; thresholds and sets come from the selection
    halves ``sel0``, ``sel1``."""
    tests: list[tuple[str, Callable[[np.ndarray], np.ndarray]]] = []
    pooled = np.concatenate([sel0, sel1]).astype(np.float64)
    for q in (0.01, 0.05, 0.2, 0.5, 0.8, 0.95, 0.99):
        tau = float(np.quantile(pooled, q))
        tests.append((f"threshold>{tau:.4g}", lambda v, tau=tau: v.astype(np.float64) > tau))
    if np.issubdtype(y.dtype, np.floating):
        for j, x in ((0, x0), (1, x1)):
            xj = float(np.asarray(x, dtype=y.dtype))
            for k in (8, 12, 16, 20, 24):
                tests.append((
                    f"bits(y-x{j})<={k}",
                    lambda v, xj=xj, k=k: _significant_bits(v.astype(np.float64) - xj) <= k,
                ))
    for k in (4, 8, 12):
        c0 = np.bincount(_low_bits(sel0, k), minlength=1 << k)
        c1 = np.bincount(_low_bits(sel1, k), minlength=1 << k)
        chosen = np.flatnonzero(c0 > c1)
        tests.append((f"lowbits[{k}]", lambda v, k=k, chosen=chosen: np.isin(_low_bits(v, k), chosen)))
    seen = np.unique(sel0)
    if seen.size < 0.5 * sel0.size:  # discrete or grid outputs repeat
        tests.append(("value-set", lambda v, seen=seen: np.isin(v, seen)))
    return tests


def _epsilon(p0: float, p1: float, delta: float) -> float:
    if p0 - delta <= 0:
        return 0.0
    if p1 <= 0:
        return math.inf
    return max(0.0, math.log((p0 - delta) / p1))


def audit_mechanism(
    release: Any,
    x0: float,
    x1: float,
    *,
    num_releases: int = 200_000,
    rng_key: jax.Array | int | None = None,
    confidence: float = 0.95,
    delta: Optional[float] = None,
    name: Optional[str] = None,
    claimed_epsilon: Optional[float] = None,
) -> AuditResult:
    """Empirical lower bound on the epsilon of ``release`` between the inputs ``x0`` and ``x1``.

    :param release: a mechanism (its ``release_many`` draws the releases: the same law as that
        many separate scalar releases) or a function ``(key, value) -> release`` (vmapped).
    :param x0, x1: neighbouring inputs (their distance should be the sensitivity).
    :param num_releases: releases per input; half select the test, half evaluate it.
    :param rng_key: key or integer seed of the releases (``None``: fresh OS entropy).
    :param confidence: confidence of the bound.
    :param delta: the delta subtracted in the bound (default: the mechanism's ``delta``, else 0).
    :param name: the name in the report (default: the mechanism's class).
    :param claimed_epsilon: the epsilon to check against (default: the mechanism's ``epsilon``).
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    if int(num_releases) != num_releases or num_releases < 100:
        raise ValueError(f"num_releases must be an integer >= 100, got {num_releases}")
    if rng_key is None:
        rng_key = secure_key()
    elif isinstance(rng_key, int):
        rng_key = jax.random.key(rng_key)
    delta = float(getattr(release, "delta", 0.0) if delta is None else delta)
    claimed = getattr(release, "epsilon", None) if claimed_epsilon is None else claimed_epsilon
    key0, key1 = jax.random.split(rng_key)
    y0 = _releases(release, key0, x0, num_releases).reshape(num_releases, -1)[:, 0]
    y1 = _releases(release, key1, x1, num_releases).reshape(num_releases, -1)[:, 0]
    half = num_releases // 2
    sel0, ev0, sel1, ev1 = y0[:half], y0[half:], y1[:half], y1[half:]
    best = ("none", lambda v: np.zeros(v.shape, bool), False, -math.inf)
    for test_name, indicator in _features(y0, x0, x1, sel0, sel1):
        s0, s1 = indicator(sel0).mean(), indicator(sel1).mean()
        for flipped, (a, b) in ((False, (s0, s1)), (True, (s1, s0))):
            score = math.log((a + 1e-3) / (b + 1e-3))  # smoothed: no division by zero
            if score > best[3]:
                best = (test_name, indicator, flipped, score)
    test_name, indicator, flipped, _ = best
    k0, k1 = int(indicator(ev0).sum()), int(indicator(ev1).sum())
    n0, n1 = ev0.size, ev1.size
    if flipped:
        (k0, n0), (k1, n1) = (k1, n1), (k0, n0)
    alpha = (1 - confidence) / 2  # Bonferroni over the two one-sided intervals
    p0_low = stats.beta.ppf(alpha, k0, n0 - k0 + 1) if k0 > 0 else 0.0
    p1_high = stats.beta.ppf(1 - alpha, k1 + 1, n1 - k1) if k1 < n1 else 1.0
    direction = " (x1 vs x0)" if flipped else ""
    return AuditResult(
        name=name or type(release).__name__,
        claimed_epsilon=None if claimed is None else float(claimed),
        epsilon_lower_bound=_epsilon(float(p0_low), float(p1_high), delta),
        test=test_name + direction,
        p0=k0 / n0,
        p1=k1 / n1,
        num_releases=int(num_releases),
        confidence=confidence,
    )


def audit_report(results: Sequence[AuditResult]) -> str:
    """A table of audit results (for the CLI and the benchmarks).

    >>> print(audit_report([AuditResult("m", 1.0, 0.4, "threshold>0", 0.3, 0.2, 1000, 0.95)]))
    | mechanism | claimed epsilon | empirical lower bound | test | releases |
    | --- | --- | --- | --- | --- |
    | m | 1 | 0.400 | threshold>0 | 1000 |
    """
    rows = [
        "| mechanism | claimed epsilon | empirical lower bound | test | releases |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in results:
        claim = "?" if r.claimed_epsilon is None else f"{r.claimed_epsilon:.4g}"
        rows.append(f"| {r.name} | {claim} | {r.epsilon_lower_bound:.3f} | {r.test} | {r.num_releases} |")
    return "\n".join(rows)


def one_run_epsilon_bound(num_correct: int, num_guesses: int, num_canaries: int, *,
                          delta: float = 0.0, confidence: float = 0.95) -> float:
    """Lower bound on epsilon from one training run with canaries (Steinke, Nasr & Jagielski 2023,
    "Privacy Auditing with One (1) Training Run").

    Each of ``num_canaries`` canaries was included independently with probability 1/2; the auditor
    guessed inclusion or exclusion for ``num_guesses`` of them and got ``num_correct`` right. Under
    epsilon-DP the number of correct guesses is stochastically dominated by
    ``Binomial(num_guesses, e^eps / (1 + e^eps))``, so the largest epsilon at which ``num_correct``
    would still be surprising at level ``1 - confidence`` is a lower bound. For (epsilon, delta)-DP
    the failure probability is reduced by ``2 * num_canaries * delta`` (a conservative additive term).

    >>> round(one_run_epsilon_bound(100, 100, 200), 2)
    3.49
    >>> one_run_epsilon_bound(55, 100, 200)
    0.0
    """
    if not 0 <= num_correct <= num_guesses or num_guesses < 1:
        raise ValueError(f"need 0 <= num_correct <= num_guesses and num_guesses >= 1, got {num_correct}, {num_guesses}")
    beta = (1 - confidence) - 2 * num_canaries * delta
    if beta <= 0:
        raise ValueError(f"delta={delta} is too large for {num_canaries} canaries at confidence {confidence}")

    def surprise(eps: float) -> float:  # P[Binomial(r, p_eps) >= num_correct]
        p = 1.0 / (1.0 + math.exp(-eps))
        return float(stats.binom.sf(num_correct - 1, num_guesses, p))

    if surprise(0.0) > beta:
        return 0.0
    lo, hi = 0.0, 1.0
    while surprise(hi) <= beta and hi < 100:
        lo, hi = hi, 2 * hi
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if surprise(mid) <= beta else (lo, mid)
    return lo


def audit_dpsvi(
    *,
    epsilon: float = 1.0,
    delta: float = 1e-5,
    num_canaries: int = 200,
    sampling_rate: float = 0.1,
    num_steps: int = 200,
    clipping_threshold: float = 1.0,
    clipping: str = "auto",
    noise_factor: float = 1.0,
    rng_key: jax.Array | int | None = None,
    confidence: float = 0.95,
    num_guesses: Optional[int] = None,
) -> AuditResult:
    """One-run canary audit of :class:`~d3pext.training.svi.DPSVI` end to end (clipping, noise,
    Poisson sampler and accountant), after Steinke, Nasr & Jagielski (2023).

    The data are canaries in ``num_canaries`` dimensions: canary ``j`` is a large value along axis
    ``j`` alone (its gradient is clipped to ``C`` along that axis), and each joins the data
    independently with probability 1/2, so that only canary ``j`` moves ``w_j``. DPSVI fits the mean ``w`` of ``Normal(w, 1)`` with Poisson batches, calibrated
    to ``(epsilon, delta)`` under the add/remove relation (one canary in or out). After the run, the
    ``num_guesses / 2`` canaries with the largest ``w_j`` are guessed in and as many with the
    smallest out; :func:`one_run_epsilon_bound` turns the correct guesses into a lower bound.
    ``noise_factor < 1`` breaks the mechanism on purpose (noise of ``noise_factor * sigma`` while
    claiming sigma's epsilon): the audit should then flag it.

    A single run's bound is weak for small epsilon (at most about 3.5 with 100 guesses at 95%):
    it shows gross failures (missing noise, clipping bypassed), not small ones.

    >>> result = audit_dpsvi(epsilon=1.0, noise_factor=1e-3, num_steps=100, rng_key=0)  # doctest: +SKIP
    >>> result.violates_claim  # doctest: +SKIP
    True
    """
    import numpyro
    import numpyro.distributions as dist
    import optax
    from numpyro.infer import Trace_ELBO
    from numpyro.infer.autoguide import AutoDelta

    from d3pext.training.svi import DPSVI

    if not 0 < noise_factor <= 1:
        raise ValueError(f"noise_factor must lie in (0, 1], got {noise_factor}")
    if rng_key is None:
        rng_key = secure_key()
    elif isinstance(rng_key, int):
        rng_key = jax.random.key(rng_key)
    num_guesses = min(100, num_canaries // 2) if num_guesses is None else int(num_guesses)
    if num_guesses < 2 or num_guesses > num_canaries or num_guesses % 2:
        raise ValueError(f"num_guesses must be even, in [2, num_canaries], got {num_guesses}")
    member_key, svi_key = jax.random.split(rng_key)
    included = np.asarray(jax.random.bernoulli(member_key, 0.5, (num_canaries,)))
    canaries = 100.0 * clipping_threshold * np.eye(num_canaries, dtype=np.float32)[included]
    data = jnp.asarray(canaries)
    n = data.shape[0]
    if n < 2:
        raise ValueError("fewer than two canaries joined the data: use more canaries")
    batch_size = max(1, round(sampling_rate * n))

    def model(x):
        w = numpyro.sample("w", dist.Normal(0.0, 10.0).expand([num_canaries]).to_event(1))
        with numpyro.plate("data", x.shape[0], subsample_size=batch_size):
            numpyro.sample("x", dist.Normal(w, 1.0).to_event(1), obs=numpyro.subsample(x, event_dim=1))

    guide = AutoDelta(model)
    calibrated = DPSVI(model, guide, optax.sgd(0.1), Trace_ELBO(),
                       clipping_threshold=clipping_threshold, epsilon=epsilon, delta=delta,
                       num_steps=num_steps, sampler="poisson", sampling_rate=sampling_rate, clipping=clipping)
    calibrated.init(svi_key, data)
    claimed = calibrated.privacy_spent(num_steps)
    svi = DPSVI(model, guide, optax.sgd(0.1), Trace_ELBO(),
                clipping_threshold=clipping_threshold, dp_scale=noise_factor * calibrated.dp_scale,
                delta=delta, sampler="poisson", sampling_rate=sampling_rate, clipping=clipping)
    result = svi.run(svi_key, num_steps, data, progress_bar=False)
    scores = np.asarray(result.params["w_auto_loc"])
    order = np.argsort(scores)
    half = num_guesses // 2
    correct = int(included[order[-half:]].sum() + (~included[order[:half]]).sum())
    return AuditResult(
        name=f"DPSVI canaries (noise x{noise_factor:g})",
        claimed_epsilon=float(claimed.epsilon),
        epsilon_lower_bound=one_run_epsilon_bound(correct, num_guesses, num_canaries, delta=delta,
                                                  confidence=confidence),
        test=f"{correct}/{num_guesses} membership guesses right",
        p0=correct / num_guesses,
        p1=1 - correct / num_guesses,
        num_releases=1,
        confidence=confidence,
    )
