"""Draw ``_static/private_vs_naive.png``: private vs naive posterior from one noisy release.

Run from the repository root (about half a minute on a laptop CPU)::

    python docs/make_figure.py

A curator releases the number of successes among ``n = 200`` binary records (true rate 0.3) through a
Laplace mechanism with ``epsilon = 0.1`` (noise scale 10 counts). The analyst's posterior of the rate
from the release alone: ``method="gibbs"`` accounts for the noise (Bernstein & Sheldon), ``"naive"``
treats the release as the exact count. The keys are fixed so that the figure is reproducible; a real
release must not use a fixed key.
"""

from pathlib import Path

import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import numpyro  # noqa: E402
import numpyro.distributions as dist  # noqa: E402
from jax import random  # noqa: E402

from d3pext import LaplaceMechanism, make_release, privatize, private_posterior  # noqa: E402

N, THETA, EPSILON = 200, 0.3, 0.1
OUT = Path(__file__).resolve().parent / "_static" / "private_vs_naive.png"


def model(n, x=None):
    theta = numpyro.sample("theta", dist.Beta(1.0, 1.0))
    with numpyro.plate("records", n):
        numpyro.sample("x", dist.Bernoulli(theta), obs=x)


def main() -> None:
    private = privatize(model, site="x", mechanism=LaplaceMechanism(EPSILON))
    records = random.bernoulli(random.key(0), THETA, (N,)).astype(jnp.int32)
    release = make_release(private, N, records, rng_key=random.key(17), reproducible=True)
    print(f"true count {int(records.sum())}, released {float(release['x_dp']):.1f}")
    draws = {}
    for method in ("gibbs", "naive"):
        mcmc = private_posterior(private, release, method=method, num_warmup=1000, num_samples=4000,
                                 num_chains=4, progress_bar=False)
        mcmc.run(random.key(1), N)
        draws[method] = np.asarray(mcmc.get_samples()["theta"])
        lo, hi = np.quantile(draws[method], [0.05, 0.95])
        print(f"{method}: mean {draws[method].mean():.3f}, 90% interval [{lo:.3f}, {hi:.3f}]")

    fig, ax = plt.subplots(figsize=(6.4, 3.4), dpi=120)
    bins = np.linspace(0.0, 0.7, 141)
    ax.hist(draws["gibbs"], bins=bins, density=True, alpha=0.6, label="private posterior (gibbs)")
    ax.hist(draws["naive"], bins=bins, density=True, alpha=0.6, label="naive (release taken as exact)")
    ax.axvline(THETA, color="k", lw=1.5, ls="--", label=f"true rate {THETA}")
    ax.set_xlabel("theta (success rate)")
    ax.set_ylabel("posterior density")
    ax.set_title(f"One Laplace release (epsilon = {EPSILON}) of a count of {int(records.sum())} among n = {N}: "
                 f"released {float(release['x_dp']):.1f}", fontsize=9)
    ax.legend(frameon=False, fontsize=8)
    fig.tight_layout()
    OUT.parent.mkdir(exist_ok=True)
    fig.savefig(OUT)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
