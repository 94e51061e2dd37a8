"""Models of the seed papers, written as ordinary NumPyro code with privacy annotations.

Names are imported on first use (``from d3pext.models import logistic_regression`` loads only
``d3pext.models.logistic``): a program that fits one model does not pay for importing all of them.
"""

import importlib

_LAZY = {
    "beta_binomial_model": "d3pext.models.expfam",
    "dirichlet_multinomial_model": "d3pext.models.expfam",
    "exponential_gamma_model": "d3pext.models.expfam",
    "private_beta_binomial": "d3pext.models.expfam",
    "private_dirichlet_multinomial": "d3pext.models.expfam",
    "private_exponential_gamma": "d3pext.models.expfam",
    "HierarchicalLogisticData": "d3pext.models.hierarchical_logistic",
    "MixtureData": "d3pext.models.mixture",
    "gaussian_mixture": "d3pext.models.mixture",
    "gaussian_mixture_guide": "d3pext.models.mixture",
    "gaussian_mixture_likelihood": "d3pext.models.mixture",
    "hierarchical_logistic_guide": "d3pext.models.hierarchical_logistic",
    "hierarchical_logistic_logits": "d3pext.models.hierarchical_logistic",
    "hierarchical_logistic_regression": "d3pext.models.hierarchical_logistic",
    "logistic_guide": "d3pext.models.logistic",
    "logistic_regression": "d3pext.models.logistic",
    "simulate_binary_images": "d3pext.models.vae",
    "simulate_hierarchical_logistic": "d3pext.models.hierarchical_logistic",
    "simulate_logistic": "d3pext.models.logistic",
    "simulate_mixture": "d3pext.models.mixture",
    "vae_decoder": "d3pext.models.vae",
    "vae_encoder": "d3pext.models.vae",
    "vae_guide": "d3pext.models.vae",
    "vae_model": "d3pext.models.vae",
    "PAPER_BETA": "d3pext.models.linear_regression",
    "PAPER_S_DP": "d3pext.models.linear_regression",
    "linear_regression_model": "d3pext.models.linear_regression",
    "linear_regression_naive_posterior": "d3pext.models.linear_regression",
    "linear_regression_reference": "d3pext.models.linear_regression",
    "linear_regression_sensitivity": "d3pext.models.linear_regression",
    "linear_regression_statistic": "d3pext.models.linear_regression",
    "private_linear_regression": "d3pext.models.linear_regression",
    "CommunityModelUpdates": "d3pext.models.poisson_factorization",
    "NetworkData": "d3pext.models.poisson_factorization",
    "TopicCorpus": "d3pext.models.poisson_factorization",
    "TopicModelUpdates": "d3pext.models.poisson_factorization",
    "community_model": "d3pext.models.poisson_factorization",
    "community_rates": "d3pext.models.poisson_factorization",
    "private_community_model": "d3pext.models.poisson_factorization",
    "private_topic_model": "d3pext.models.poisson_factorization",
    "simulate_network": "d3pext.models.poisson_factorization",
    "simulate_topic_corpus": "d3pext.models.poisson_factorization",
    "topic_model": "d3pext.models.poisson_factorization",
    "topic_rates": "d3pext.models.poisson_factorization",
    "PAPER_FLU_S_DP": "d3pext.models.sir",
    "PAPER_SIR_S_DP": "d3pext.models.sir",
    "PAPER_SIR_THETA": "d3pext.models.sir",
    "PAPER_TIMES": "d3pext.models.sir",
    "SIRTrajectory": "d3pext.models.sir",
    "gillespie_sir": "d3pext.models.sir",
    "private_sir": "d3pext.models.sir",
    "sir_model": "d3pext.models.sir",
    "BLOOD_LEAD": "d3pext.models.bounded_gaussian",
    "bounded_gaussian_model": "d3pext.models.bounded_gaussian",
    "private_bounded_gaussian": "d3pext.models.bounded_gaussian",
    "BROWNLEE_LIKE": "d3pext.models.constrained_regression",
    "constrained_regression_model": "d3pext.models.constrained_regression",
    "private_constrained_regression": "d3pext.models.constrained_regression",
    "simulate_drinking_cirrhosis": "d3pext.models.constrained_regression",
    "NaiveBayesRecords": "d3pext.models.naive_bayes",
    "naive_bayes_log_likelihood": "d3pext.models.naive_bayes",
    "naive_bayes_model": "d3pext.models.naive_bayes",
    "naive_bayes_naive_posterior": "d3pext.models.naive_bayes",
    "naive_bayes_reference": "d3pext.models.naive_bayes",
    "naive_bayes_sensitivity": "d3pext.models.naive_bayes",
    "naive_bayes_statistic": "d3pext.models.naive_bayes",
    "private_naive_bayes": "d3pext.models.naive_bayes",
    "simulate_naive_bayes": "d3pext.models.naive_bayes",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    try:  # a submodule, e.g. d3pext.models.vae, as an attribute
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as error:
        if error.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_LAZY])
