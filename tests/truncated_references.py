"""Exact posteriors of an exponential or a Poisson rate given a Laplace release of the truncated sum of its
records, shared by the test files that check the exponential-family Gibbs sampler against them."""

from __future__ import annotations

import numpy as np
from scipy import stats


def fourier_posterior(y, n, bounds, scale, prior_pdf, grid, w_max=0.25, num=25001):
    """p(lam | y) on ``grid`` by Fourier inversion of p(y | lam) = E[Laplace(y; s_c, scale)].

    s_c sums n iid copies of w = 1_[a,b](x) x, whose characteristic function is
    (1 - q) + lam / (lam - i w) (e^{(iw - lam) a} - e^{(iw - lam) b}); the Laplace noise has
    characteristic function 1 / (1 + scale^2 w^2). The integral over frequencies runs on ``num`` points of
    ``[0, w_max]``: the integrand decays like ``exp(-n w^2 Var(x 1_[a,b]) / 2)``, so many records need a
    short range, a few a longer one.
    """
    a, b = bounds
    w = np.linspace(0.0, w_max, num)[:, None]
    lam = grid[None]
    ea, eb = np.exp(-lam * a), np.exp(-lam * b)  # the exponentials factor into w and lam parts
    cf = (1 - (ea - eb)) + lam / (lam - 1j * w) * (ea * np.exp(1j * w * a) - eb * np.exp(1j * w * b))
    # Re(cf^n e^{-iwy}) = |cf|^n cos(n arg cf - w y): a fifth of the time of the complex power
    integrand = np.exp(n * np.log(np.abs(cf))) * np.cos(n * np.angle(cf) - w * y) / (1 + (scale * w) ** 2)
    post = prior_pdf(grid) * np.trapezoid(integrand, w[:, 0], axis=0)
    return post / np.trapezoid(post, grid)


def poisson_posterior(y, n, bound, scale, prior_pdf, grid):
    """p(rate | y) on ``grid`` for the release of ``sum_i x_i 1[x_i <= bound]`` of ``n`` Poisson records plus
    Laplace noise: the sum's pmf is the n-th power of the per-record pmf's discrete Fourier transform (long
    enough, ``n bound + 1`` values, to hold the sum without wrapping around)."""
    per_record = stats.poisson.pmf(np.arange(bound + 1)[None], grid[:, None])
    per_record[:, 0] += stats.poisson.sf(bound, grid)  # a record above the bound adds 0
    size = n * bound + 1
    pmf = np.fft.irfft(np.fft.rfft(per_record, size, axis=1) ** n, size, axis=1)
    lik = (np.clip(pmf, 0.0, None) * stats.laplace.pdf(y, np.arange(size)[None], scale)).sum(1)
    post = prior_pdf(grid) * lik
    return post / np.trapezoid(post, grid)
