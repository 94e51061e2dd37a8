"""The inverse Gaussian (Wald) law: the full conditional of the precision in the normal
scale-mixture representation of Laplace noise (Bernstein & Sheldon, seed 004, section 3),
including the Levy limit ``loc = inf`` reached when a noisy statistic equals its release.
"""

from typing import Optional

import jax
from jax import lax, random
import jax.numpy as jnp
from jax.scipy.special import erfcx, ndtr
from jax.typing import ArrayLike

from numpyro.distributions import constraints
from numpyro.distributions.distribution import Distribution
from numpyro.distributions.util import promote_shapes, validate_sample
from numpyro.util import is_prng_key

from d3pext.dtypes import float_dtype

Array = jax.Array

__all__ = ["InverseGaussian"]


class InverseGaussian(Distribution):
    r"""Inverse Gaussian (Wald) distribution with mean ``loc`` and shape ``concentration``:

    .. math::
        p(x \mid \mu, \lambda) = \sqrt{\frac{\lambda}{2 \pi x^3}}
            \exp\left(-\frac{\lambda (x - \mu)^2}{2 \mu^2 x}\right), \quad x > 0.

    ``loc = inf`` is allowed and gives the Levy limit
    :math:`\sqrt{\lambda / (2\pi x^3)} \exp(-\lambda / (2x))` in :meth:`sample`, :meth:`log_prob`
    and :meth:`cdf`, with finite gradients (the formulas use :math:`x/\mu` and a double-where at
    :math:`\mu = \infty`). This is the full conditional of the precision :math:`1/\sigma^2` in the scale-mixture representation of
    Laplace noise (seed 004, Appendix B), whose mean :math:`\epsilon / (\Delta |y - s|)` is
    infinite when the statistic ``s`` equals its release ``y``.

    Sampling uses Michael, Schucany & Haas (1976), rearranged so that it has no cancellation
    for large means. The sampler is not reparametrized (its accept step jumps).

    :param loc: the mean :math:`\mu > 0`, possibly ``inf``.
    :param concentration: the shape :math:`\lambda > 0`.

    >>> import jax
    >>> from d3pext.distributions import InverseGaussian
    >>> d = InverseGaussian(2.0, 3.0)
    >>> d.sample(jax.random.PRNGKey(0), (4,)).shape
    (4,)
    >>> float(InverseGaussian(float("inf"), 1.0).log_prob(1.0))  # Levy(1) at 1
    -1.418...
    """

    arg_constraints = {"loc": constraints.positive, "concentration": constraints.positive}
    support = constraints.positive
    reparametrized_params = []

    def __init__(
        self,
        loc: ArrayLike = 1.0,
        concentration: ArrayLike = 1.0,
        *,
        validate_args: Optional[bool] = None,
    ) -> None:
        self.loc, self.concentration = promote_shapes(loc, concentration)
        batch_shape = lax.broadcast_shapes(jnp.shape(loc), jnp.shape(concentration))
        super().__init__(batch_shape=batch_shape, validate_args=validate_args)

    def sample(self, key: Array, sample_shape: tuple[int, ...] = ()) -> Array:
        assert is_prng_key(key)
        shape = sample_shape + self.batch_shape
        key_normal, key_uniform = random.split(key)
        dtype = float_dtype(self.loc, self.concentration)
        inv_mean = 1.0 / jnp.asarray(self.loc, dtype)
        z = random.normal(key_normal, shape, dtype)
        # a = chi2_1 / (2 lambda); the smaller root of the MSH quadratic is
        # mu / (1 + w + sqrt(w^2 + 2w)) with w = mu a, i.e. 1 / (r + a + sqrt(a^2 + 2 r a))
        # with r = 1/mu.
        a = jnp.maximum(z * z / (2 * self.concentration), jnp.finfo(dtype).tiny)
        x = 1.0 / (inv_mean + a + jnp.sqrt(a * a + 2 * inv_mean * a))
        u = random.uniform(key_uniform, shape, dtype)
        # Keep x with probability mu / (mu + x) = 1 / (1 + x r), else take mu^2 / x.
        return jnp.where(u * (1 + x * inv_mean) <= 1, x, self.loc * (self.loc / x))

    def _relative_deviation(self, value: ArrayLike) -> Array:
        # (x - mu) / mu, exact for x near mu; -1 at mu = inf.  Double-where keeps the gradient
        # with respect to mu finite (zero) at mu = inf.
        finite = jnp.isfinite(self.loc)
        loc = jnp.where(finite, self.loc, 1.0)
        return jnp.where(finite, (value - loc) / loc, -1.0)

    @validate_sample
    def log_prob(self, value: ArrayLike) -> Array:
        lam = self.concentration
        dev = self._relative_deviation(value)
        log_normalizer = 0.5 * (jnp.log(lam) - jnp.log(2 * jnp.pi) - 3 * jnp.log(value))
        return log_normalizer - lam * dev * dev / (2 * value)

    def cdf(self, value: ArrayLike) -> Array:
        """Cumulative distribution function (for ``loc = inf``: ``erfc(sqrt(lam / (2 x)))``).

        Uses ``exp(2 lam / mu) Phi(-w) = erfcx(w / sqrt 2) exp(-lam (x - mu)^2 / (2 mu^2 x)) / 2``
        with ``w = sqrt(lam / x) (x / mu + 1)``, which cannot overflow.
        """
        lam = self.concentration
        dev = self._relative_deviation(value)
        root = jnp.sqrt(lam / value)
        w = root * (value / self.loc + 1)
        return ndtr(root * dev) + 0.5 * erfcx(w / jnp.sqrt(2.0)) * jnp.exp(
            -lam * dev * dev / (2 * value)
        )

    @property
    def mean(self) -> Array:
        return jnp.broadcast_to(self.loc, self.batch_shape)

    @property
    def variance(self) -> Array:
        return jnp.broadcast_to(self.loc**3 / self.concentration, self.batch_shape)


# ---------------------------------------------------------------------------------------------
# Two-sided geometric
# ---------------------------------------------------------------------------------------------
