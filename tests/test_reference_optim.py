"""The NumPy optimizer references (Adam, AdamW, Nesterov SGD) against closed forms and torch."""

import numpy as np
import pytest

from dask_ipar.reference import adam_step, sgd_step

SHAPES = [((4, 3), (4,)), ((2, 4), (2,))]


def _problem(seed=0, steps=5):
    rng = np.random.default_rng(seed)
    params = [(rng.standard_normal(sw), rng.standard_normal(sb)) for sw, sb in SHAPES]
    grads = [[(rng.standard_normal(sw), rng.standard_normal(sb)) for sw, sb in SHAPES]
             for _ in range(steps)]
    return params, grads


def _torch_run(opt_name, params, grads, lr, wd, **kw):
    torch = pytest.importorskip("torch")
    ws = [torch.tensor(W, dtype=torch.float64, requires_grad=True) for W, _ in params]
    bs = [torch.tensor(b, dtype=torch.float64, requires_grad=True) for _, b in params]
    groups = [{"params": ws, "weight_decay": wd}, {"params": bs, "weight_decay": 0.0}]
    cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[opt_name]
    opt = cls(groups, lr=lr, foreach=False, **kw)
    for g in grads:
        for t, (gW, gb) in zip(ws, g):
            t.grad = torch.tensor(gW, dtype=torch.float64)
        for t, (gW, gb) in zip(bs, g):
            t.grad = torch.tensor(gb, dtype=torch.float64)
        opt.step()
    return [(W.detach().numpy(), b.detach().numpy()) for W, b in zip(ws, bs)]


def _maxdiff(a, b):
    return max(max(np.abs(x - y).max() for x, y in zip(pa, pb)) for pa, pb in zip(a, b))


@pytest.mark.fast
@pytest.mark.parametrize("decoupled", [False, True], ids=["adam", "adamw"])
@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.3, 0.9)], ids=["default", "lerp-high"])
def test_adam_matches_torch(decoupled, betas):
    params, grads = _problem()
    lr, wd, eps = 0.01, 0.01, 1e-8
    ref = _torch_run("adamw" if decoupled else "adam", params, grads, lr, wd,
                     betas=betas, eps=eps)
    p, state = params, [None] * len(params)
    for t, g in enumerate(grads, start=1):
        p, state = adam_step(p, state, g, lr, betas=betas, eps=eps, weight_decay=wd,
                             decoupled=decoupled, step=t)
    diff = _maxdiff(p, ref)
    print(f"max |numpy - torch| = {diff:.3e}")
    assert diff <= 1e-12
    assert _maxdiff(p, params) > 1e-3  # it did move


@pytest.mark.fast
@pytest.mark.parametrize("nesterov", [False, True], ids=["momentum", "nesterov"])
def test_sgd_matches_torch(nesterov):
    params, grads = _problem(seed=1)
    lr, wd, mu = 0.05, 0.01, 0.9
    ref = _torch_run("sgd", params, grads, lr, wd, momentum=mu, nesterov=nesterov)
    p, vel = params, [None] * len(params)
    for g in grads:
        p, vel = sgd_step(p, vel, g, lr, momentum=mu, weight_decay=wd, nesterov=nesterov)
    diff = _maxdiff(p, ref)
    print(f"max |numpy - torch| = {diff:.3e}")
    assert diff <= 1e-12


# ------------------------------------------------------------ torch-free checks


@pytest.mark.fast
def test_adam_first_step_closed_form():
    # At t = 1 the bias corrections give m_hat = g and v_hat = g^2, so the update is
    # lr * g / (|g| + eps): ~lr * sign(g) for large |g|, halved where |g| = eps, 0 at 0.
    lr, eps = 0.1, 1e-8
    W = np.arange(6.0).reshape(2, 3)
    b = np.array([1.0, -1.0])
    gW = np.array([[3.0, -2e-3, 1e-8], [-1e-8, 0.0, 5e4]])
    gb = np.array([-7.0, 1e-12])
    (W1, b1), = adam_step([(W, b)], [None], [(gW, gb)], lr, eps=eps)[0]
    # atol: W - W1 loses the last bits of W (|W| <= 5) to cancellation.
    np.testing.assert_allclose(W - W1, lr * np.sign(gW) * np.abs(gW) / (np.abs(gW) + eps),
                               rtol=1e-13, atol=4e-15)
    np.testing.assert_allclose(b - b1, lr * gb / (np.abs(gb) + eps), rtol=1e-13, atol=1e-15)
    assert W[0, 2] - W1[0, 2] == pytest.approx(lr / 2, rel=1e-13)
    assert W1[1, 1] == W[1, 1]


@pytest.mark.fast
def test_adam_constant_gradient_bias_correction():
    # With a constant gradient, m_hat = g and v_hat = g^2 at every step t, so each
    # step moves W by exactly lr * g / (|g| + eps): the bias corrections at t > 1.
    lr, steps = 0.01, 6
    rng = np.random.default_rng(3)
    W, gW = rng.standard_normal((3, 2)), rng.standard_normal((3, 2))
    p, state = [(W, None)], [None]
    for t in range(1, steps + 1):
        p, state = adam_step(p, state, [(gW, None)], lr, betas=(0.8, 0.99), step=t)
        assert state[0][1] is None and p[0][1] is None
    np.testing.assert_allclose(p[0][0], W - steps * lr * gW / (np.abs(gW) + 1e-8),
                               rtol=1e-12, atol=1e-15)


@pytest.mark.fast
def test_adamw_zero_grads_only_shrinks_weights():
    # Zero gradients keep m = v = 0, so the Adam update is 0 / (0 + eps) = 0 and AdamW
    # only multiplies W by (1 - lr * wd) each step; biases never decay.
    lr, wd = 0.1, 0.5
    rng = np.random.default_rng(4)
    W, b = rng.standard_normal((3, 4)), rng.standard_normal(3)
    zero = [(np.zeros_like(W), np.zeros_like(b))]
    p, state = [(W, b)], [None]
    expect = W
    for t in range(1, 4):
        p, state = adam_step(p, state, zero, lr, weight_decay=wd, decoupled=True, step=t)
        expect = expect * (1 - lr * wd)
        assert np.array_equal(p[0][0], expect)
        assert np.array_equal(p[0][1], b)
    # Coupled Adam instead feeds g = wd * W into the moments: at t = 1 a step of
    # lr * g / (|g| + eps), close to lr * sign(W), and W does not shrink by (1 - lr wd).
    (W1, b1), = adam_step([(W, b)], [None], zero, lr, weight_decay=wd)[0]
    g = wd * W
    np.testing.assert_allclose(W - W1, lr * g / (np.abs(g) + 1e-8), rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(W - W1, lr * np.sign(W), rtol=1e-4)
    assert np.array_equal(b1, b)


@pytest.mark.fast
def test_nesterov_closed_form():
    lr, mu = 0.1, 0.9
    rng = np.random.default_rng(5)
    W, b = rng.standard_normal((2, 3)), rng.standard_normal(2)
    g1 = (rng.standard_normal((2, 3)), rng.standard_normal(2))
    g2 = (rng.standard_normal((2, 3)), rng.standard_normal(2))
    p1, v1 = sgd_step([(W, b)], [None], [g1], lr, momentum=mu, nesterov=True)
    for x, x1, g in zip((W, b), p1[0], g1):
        np.testing.assert_allclose(x - x1, lr * (1 + mu) * g, rtol=1e-14)
    p2, _ = sgd_step(p1, v1, [g2], lr, momentum=mu, nesterov=True)
    for x1, x2, ga, gb in zip(p1[0], p2[0], g1, g2):
        np.testing.assert_allclose(x1 - x2, lr * (gb + mu * (mu * ga + gb)), rtol=1e-13)
    # Without nesterov the step is the momentum buffer itself, as before.
    q1, w1 = sgd_step([(W, b)], [None], [g1], lr, momentum=mu)
    q2, _ = sgd_step(q1, w1, [g2], lr, momentum=mu)
    for x1, x2, ga, gb in zip(q1[0], q2[0], g1, g2):
        np.testing.assert_allclose(x1 - x2, lr * (mu * ga + gb), rtol=1e-13)
    with pytest.raises(ValueError):
        sgd_step([(W, b)], [None], [g1], lr, momentum=0.0, nesterov=True)


@pytest.mark.fast
@pytest.mark.parametrize("max_norm", [0.5, 1e3], ids=["clipped", "untouched"])
def test_clip_grads_matches_torch(max_norm):
    """reference.clip_grads against torch.nn.utils.clip_grad_norm_ over W and b of two
    layers (one without bias)."""
    torch = pytest.importorskip("torch")
    from dask_ipar.reference import clip_grads

    rng = np.random.default_rng(4)
    grads = [(rng.standard_normal((4, 3)), rng.standard_normal(4)),
             (rng.standard_normal((2, 4)), None)]
    mine, norm = clip_grads(grads, max_norm)
    tensors = [torch.zeros(g.shape, dtype=torch.float64, requires_grad=True)
               for pair in grads for g in pair if g is not None]
    for t, g in zip(tensors, [g for pair in grads for g in pair if g is not None]):
        t.grad = torch.from_numpy(g.copy())
    total = torch.nn.utils.clip_grad_norm_(tensors, max_norm)
    assert float(total) == pytest.approx(norm, rel=1e-14)
    got = [g for pair in mine for g in pair if g is not None]
    assert max(np.abs(t.grad.numpy() - g).max() for t, g in zip(tensors, got)) <= 1e-15
    assert mine[1][1] is None
    if max_norm > norm:
        assert all(np.array_equal(a, b) for a, b in zip(got, [g for pair in grads for g in pair
                                                               if g is not None]))
