"""Models of the seed papers, written as ordinary NumPyro code with privacy annotations."""

from d3pext.models.expfam import (
    beta_binomial_model,
    dirichlet_multinomial_model,
    exponential_gamma_model,
    private_beta_binomial,
    private_dirichlet_multinomial,
    private_exponential_gamma,
)
from d3pext.models.hierarchical_logistic import (
    HierarchicalLogisticData,
    hierarchical_logistic_guide,
    hierarchical_logistic_logits,
    hierarchical_logistic_regression,
    simulate_hierarchical_logistic,
)
from d3pext.models.logistic import logistic_guide, logistic_regression, simulate_logistic
from d3pext.models.mixture import (
    MixtureData,
    gaussian_mixture,
    gaussian_mixture_guide,
    gaussian_mixture_likelihood,
    simulate_mixture,
)
from d3pext.models.vae import simulate_binary_images, vae_decoder, vae_encoder, vae_guide, vae_model

__all__ = [
    "beta_binomial_model",
    "dirichlet_multinomial_model",
    "exponential_gamma_model",
    "private_beta_binomial",
    "private_dirichlet_multinomial",
    "private_exponential_gamma",
    "HierarchicalLogisticData",
    "MixtureData",
    "gaussian_mixture",
    "gaussian_mixture_guide",
    "gaussian_mixture_likelihood",
    "hierarchical_logistic_guide",
    "hierarchical_logistic_logits",
    "hierarchical_logistic_regression",
    "logistic_guide",
    "logistic_regression",
    "simulate_binary_images",
    "simulate_hierarchical_logistic",
    "simulate_logistic",
    "simulate_mixture",
    "vae_decoder",
    "vae_encoder",
    "vae_guide",
    "vae_model",
]
