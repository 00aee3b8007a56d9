"""The Gaussian diffusion against the closed forms of DDPM (Ho et al. 2020, arXiv 2006.11239, Eqs. 4, 6-7)
and ADM (arXiv 2102.09672: learned-range variance, hybrid loss, respacing)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from normexp.diffusion import (
    GaussianDiffusion,
    discretized_gaussian_log_likelihood,
    guided,
    linear_betas,
    normal_kl,
    spaced_steps,
)


@pytest.fixture(scope="module")
def diffusion() -> GaussianDiffusion:
    return GaussianDiffusion.create(1000)


def test_linear_betas_are_adms():
    betas = linear_betas(1000)
    assert betas[0] == pytest.approx(1e-4) and betas[-1] == pytest.approx(0.02) and len(betas) == 1000
    assert linear_betas(250)[0] == pytest.approx(4e-4)  # scaled by 1000 / steps


def test_q_sample_and_the_posterior_equal_the_closed_forms(diffusion):
    torch.manual_seed(0)
    x0, noise = torch.randn(3, 2, 4, 4), torch.randn(3, 2, 4, 4)
    t = torch.tensor([0, 500, 999])
    abar = np.cumprod(1 - diffusion.betas)
    xt = diffusion.q_sample(x0, t, noise)
    for i, step in enumerate(t.tolist()):
        expected = math.sqrt(abar[step]) * x0[i] + math.sqrt(1 - abar[step]) * noise[i]
        torch.testing.assert_close(xt[i], expected)
    mean, variance, _ = diffusion.q_posterior(x0, xt, t)
    for i, step in enumerate(t.tolist()):
        prev = abar[step - 1] if step > 0 else 1.0
        beta = diffusion.betas[step]
        mu = (math.sqrt(prev) * beta / (1 - abar[step])) * x0[i] + \
            (math.sqrt(1 - beta) * (1 - prev) / (1 - abar[step])) * xt[i]
        torch.testing.assert_close(mean[i], mu)
        assert variance[i].item() == pytest.approx((1 - prev) / (1 - abar[step]) * beta, rel=1e-6)


def test_respacing_keeps_alpha_bar_and_recomputes_the_betas(diffusion):
    kept = spaced_steps(1000, "250")
    assert len(kept) == 250 and kept[0] == 0 and kept[-1] == 999
    assert spaced_steps(1000, "ddim50") == list(range(0, 1000, 20))
    # two sections of 50: strides 49/9 and 49/4 summed, rounded half to even (round(24.5) = 24) as ADM does
    assert spaced_steps(100, "10,5") == [0, 5, 11, 16, 22, 27, 33, 38, 44, 49, 50, 62, 74, 87, 99]
    spaced = diffusion.respaced("250")
    np.testing.assert_allclose(spaced.alphas_cumprod, diffusion.alphas_cumprod[kept], rtol=1e-12)
    previous = np.append(1.0, diffusion.alphas_cumprod[kept][:-1])
    np.testing.assert_allclose(spaced.betas, 1 - diffusion.alphas_cumprod[kept] / previous, rtol=1e-12)
    assert spaced.timestep_map.tolist() == kept
    with pytest.raises(ValueError, match="cannot take"):
        spaced_steps(10, "11")


def test_the_learned_range_interpolates_between_the_two_log_variances(diffusion):
    xt, t = torch.zeros(2, 1, 2, 2), torch.tensor([3, 700])
    for v, expected in ((1.0, np.log(diffusion.betas)), (-1.0, diffusion.posterior_log_variance_clipped)):
        output = torch.cat([torch.zeros_like(xt), torch.full_like(xt, v)], dim=1)
        log_variance = diffusion.p_mean_variance(output, xt, t)["log_variance"]
        torch.testing.assert_close(log_variance[:, 0, 0, 0], torch.tensor(expected[[3, 700]]).float())


def test_a_model_without_learned_variance_samples_at_dits_fixed_variance():
    """DiT's create_diffusion(learn_sigma=False): ADM's FIXED_LARGE, beta_t (at t = 0 the posterior's
    variance of step 1), respaced with the betas; sigma_small: FIXED_SMALL, the posterior's; the loss is the
    MSE alone."""
    betas = linear_betas(1000)
    abar = np.cumprod(1 - betas)
    posterior_1 = betas[1] * (1 - abar[0]) / (1 - abar[1])
    xt, t = torch.zeros(3, 2, 2, 2), torch.tensor([0, 1, 700])
    large = GaussianDiffusion.create(1000, learn_sigma=False)
    log_variance = large.p_mean_variance(torch.zeros_like(xt), xt, t)["log_variance"][:, 0, 0, 0]
    expected = np.log([posterior_1, betas[1], betas[700]])
    torch.testing.assert_close(log_variance, torch.tensor(expected).float())
    spaced = GaussianDiffusion.create(1000, "25", learn_sigma=False)
    np.testing.assert_allclose(spaced.fixed_log_variance[1:], np.log(spaced.betas[1:]))
    small = GaussianDiffusion.create(1000, learn_sigma=False, sigma_small=True)
    np.testing.assert_array_equal(small.fixed_log_variance, small.posterior_log_variance_clipped)
    x0 = torch.randn(3, 2, 2, 2)
    terms = large.training_losses(lambda x, steps, **_: torch.zeros_like(x), x0, t, torch.ones_like(x0))
    assert "vb" not in terms and torch.equal(terms["loss"], terms["mse"])


def test_the_bound_at_t0_is_the_discretised_decoder_likelihood(diffusion):
    torch.manual_seed(1)
    x0 = torch.rand(2, 3, 4, 4) * 2 - 1
    t = torch.zeros(2, dtype=torch.long)
    xt = diffusion.q_sample(x0, t, torch.randn_like(x0))
    output = torch.randn(2, 6, 4, 4) * 0.1
    p = diffusion.p_mean_variance(output, xt, t)
    nll = -discretized_gaussian_log_likelihood(x0, p["mean"], 0.5 * p["log_variance"]).mean((1, 2, 3))
    torch.testing.assert_close(diffusion.vb_terms_bpd(output, x0, xt, t), nll / math.log(2))
    # for t > 0 it is the KL between the Gaussians, in bits
    t = torch.tensor([10, 10])
    p = diffusion.p_mean_variance(output, xt, t)
    true_mean, _, true_log_variance = diffusion.q_posterior(x0, xt, t)
    kl = normal_kl(true_mean, true_log_variance, p["mean"], p["log_variance"]).mean((1, 2, 3)) / math.log(2)
    torch.testing.assert_close(diffusion.vb_terms_bpd(output, x0, xt, t), kl)


def test_the_decoder_likelihood_of_a_sharp_gaussian_is_its_bin():
    x = torch.tensor([0.0, 1.0, -1.0])
    log_p = discretized_gaussian_log_likelihood(x, x, torch.full_like(x, math.log(1e-4)))
    torch.testing.assert_close(log_p, torch.zeros(3), atol=1e-6, rtol=0)  # all the mass in the right bin


def test_the_hybrid_loss_is_mse_plus_a_bound_that_trains_only_the_variance(diffusion):
    torch.manual_seed(2)
    weight = torch.randn(4, 2, requires_grad=True)  # a 1x1 "model": 2 channels in, eps and v out

    def model(x, t):
        return torch.einsum("oc,bchw->bohw", weight, x)

    x0, noise, t = torch.randn(3, 2, 3, 3), torch.randn(3, 2, 3, 3), torch.tensor([0, 5, 900])
    terms = diffusion.training_losses(model, x0, t, noise)
    eps = model(diffusion.q_sample(x0, t, noise), t)[:, :2]
    torch.testing.assert_close(terms["mse"], ((noise - eps) ** 2).mean((1, 2, 3)))
    torch.testing.assert_close(terms["loss"], terms["mse"] + terms["vb"])
    terms["vb"].sum().backward()
    assert weight.grad[:2].abs().sum() == 0 and weight.grad[2:].abs().sum() > 0  # stop-gradient on the mean


def test_ancestral_sampling_with_the_exact_noise_predictor_lands_on_the_data():
    """Data = one point c: the optimal epsilon is known in closed form, and every respaced sampler must
    end exactly at c (the last step's mean is x0 itself)."""
    c = torch.tensor([0.3, -0.7]).view(1, 2, 1, 1)
    abar = torch.from_numpy(np.cumprod(1 - linear_betas(1000))).float()

    def exact(x, t):  # the model sees the original step index
        a = abar[t].view(-1, 1, 1, 1)
        eps = (x - a.sqrt() * c) / (1 - a).sqrt()
        return torch.cat([eps, torch.zeros_like(eps)], dim=1)

    for spacing in (None, "25", "ddim10"):
        diffusion = GaussianDiffusion.create(1000, spacing)
        generator = torch.Generator().manual_seed(0)
        samples = diffusion.p_sample_loop(exact, torch.randn(4, 2, 1, 1, generator=generator), generator)
        torch.testing.assert_close(samples, c.expand(4, -1, -1, -1), atol=1e-4, rtol=0)


def test_guidance_scale_one_is_the_conditional_model_and_other_scales_extrapolate():
    calls = []

    def model(x, t, y):
        calls.append(len(x))
        return torch.cat([x * (y.view(-1, 1, 1, 1) + 1), -x], dim=1)

    x, t, y = torch.ones(2, 2, 1, 1), torch.zeros(2).long(), torch.tensor([1, 2])
    assert guided(model, 1.0, null_label=9, channels=2) is model
    out = guided(model, 4.0, null_label=9, channels=2)(x, t, y)
    conditional, unconditional = model(x, t, y), model(x, t, torch.full_like(y, 9))
    eps_c, eps_u = conditional[:, :2], unconditional[:, :2]
    torch.testing.assert_close(out[:, :2], eps_u + 4.0 * (eps_c - eps_u))
    torch.testing.assert_close(out[:, 2:], conditional[:, 2:])
    assert calls[0] == 4  # one forward over the doubled batch


def test_clip_denoised_clamps_the_predicted_x0(diffusion):
    xt, t = torch.full((1, 1, 1, 1), 3.0), torch.tensor([10])
    output = torch.cat([torch.full_like(xt, -5.0), torch.zeros_like(xt)], dim=1)  # eps far off: x0 > 1
    assert diffusion.p_mean_variance(output, xt, t)["x0"].item() > 1
    clipped = diffusion.p_mean_variance(output, xt, t, clip_denoised=True)
    assert clipped["x0"].item() == 1.0
    torch.testing.assert_close(clipped["mean"], diffusion.q_posterior(torch.ones_like(xt), xt, t)[0])
