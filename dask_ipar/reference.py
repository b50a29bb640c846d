"""Single-process NumPy reference of the models dask-ipar trains.

Written directly from the definitions with whole matrices, sharing no code
with the distributed engine, so that tests can compare the two. Layout:
``W`` is ``d_out x d_in``, ``X`` is ``d_in x B`` (one column per sample),
loss is the mean softmax cross-entropy, and SGD is PyTorch's (momentum
buffer ``v = mu v + g + wd W``; weight decay not applied to biases). Adam and
AdamW (``adam_step``) follow Kingma & Ba 2015 and Loshchilov & Hutter 2019 in
the floating-point order of ``torch.optim.Adam``'s single-tensor path.
"""

from __future__ import annotations

import numpy as np

__all__ = ["clip_grads", "mlp_forward", "mlp_loss_and_grads", "sgd_step", "adam_step",
           "cnn_loss_and_grads"]


def _act(z, name):
    if name == "relu":
        return np.maximum(z, 0)
    if name == "tanh":
        return np.tanh(z)
    return z


def _act_grad(z, name):
    if name == "relu":
        return (z > 0).astype(z.dtype)
    if name == "tanh":
        return 1 - np.tanh(z) ** 2
    return np.ones_like(z)


def mlp_forward(params, activations, X):
    """Return logits (``classes x B``) and the list of pre-activations and inputs."""
    xs, zs = [X], []
    a = X
    for (W, b), act in zip(params, activations):
        z = W @ a + (b[:, None] if b is not None else 0)
        zs.append(z)
        a = _act(z, act)
        xs.append(a)
    return a, xs, zs


def _softmax_xent(logits, y):
    """Mean cross-entropy of ``classes x B`` logits, accuracy, and d(loss)/d(logits)."""
    B = logits.shape[1]
    m = logits.max(axis=0, keepdims=True)
    lse = np.log(np.exp(logits - m).sum(axis=0)) + m[0]
    loss = float(np.mean(lse - logits[y, np.arange(B)]))
    acc = float(np.mean(logits.argmax(axis=0) == y))
    d = np.exp(logits - lse[None, :])
    d[y, np.arange(B)] -= 1
    return loss, acc, d / B


def mlp_loss_and_grads(params, activations, X, y):
    """Mean cross-entropy loss, accuracy and gradients ``[(dW, db), ...]``."""
    logits, xs, zs = mlp_forward(params, activations, X)
    loss, acc, dz = _softmax_xent(logits, y)
    grads = [None] * len(params)
    for k in range(len(params) - 1, -1, -1):
        W, b = params[k]
        dz = dz * _act_grad(zs[k], activations[k])
        grads[k] = (dz @ xs[k].T, dz.sum(axis=1) if b is not None else None)
        dz = W.T @ dz
    return loss, acc, grads


def sgd_step(params, velocity, grads, lr, momentum=0.0, weight_decay=0.0, nesterov=False):
    """One SGD step in place of new lists; ``velocity`` entries may be None at first.

    As ``torch.optim.SGD`` with dampening 0: ``g <- g + wd W`` (not for biases),
    ``v <- mu v + g`` (``v = g`` at the first step), then ``W <- W - lr d`` with
    ``d = v``, or with ``nesterov`` (which needs ``momentum > 0``) ``d = g + mu v``.
    """
    if nesterov and momentum <= 0:
        raise ValueError("Nesterov momentum requires a positive momentum")
    new_p, new_v = [], []
    for (W, b), (gW, gb), v in zip(params, grads, velocity):
        gW = gW + weight_decay * W
        if v is None:
            vW, vb = gW, gb
        else:
            vW = momentum * v[0] + gW
            vb = None if gb is None else momentum * v[1] + gb
        if nesterov:
            dW = gW + momentum * vW
            db = None if gb is None else gb + momentum * vb
        else:
            dW, db = vW, vb
        new_p.append((W - lr * dW, None if b is None else b - lr * db))
        new_v.append((vW, vb))
    return new_p, new_v


def _lerp(start, end, weight):
    """``torch.lerp`` with a scalar weight, taking the branch it takes."""
    if abs(weight) < 0.5:
        return start + weight * (end - start)
    return end - (end - start) * (1 - weight)


def _adam_tensor(p, g, mv, lr, b1, b2, eps, wd, decoupled, step):
    if wd != 0:
        if decoupled:
            p = p * (1 - lr * wd)
        else:
            g = g + wd * p
    m, v = (np.zeros_like(p), np.zeros_like(p)) if mv is None else mv
    m = _lerp(m, g, 1 - b1)
    v = v * b2 + (1 - b2) * g * g
    bias_correction1 = 1 - b1 ** step
    bias_correction2 = 1 - b2 ** step
    step_size = lr / bias_correction1
    denom = np.sqrt(v) / bias_correction2 ** 0.5 + eps
    return p + (-step_size) * m / denom, (m, v)


def adam_step(params, state, grads, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
              decoupled=False, step=1):
    """One Adam (or, with ``decoupled``, AdamW) step; returns ``(new_params, new_state)``.

    ``state`` has one entry per layer: None before the first step, else
    ``((mW, vW), (mb, vb))`` (``(mb, vb)`` None when ``b`` is None); ``step`` is the
    1-based step count ``t`` of the bias corrections. Weight decay acts on ``W`` only,
    never on biases. Per tensor, with ``b1, b2 = betas`` and ``m = v = 0`` before the
    first step, the floating-point operations are those, in that order, of
    ``torch.optim.Adam`` / ``AdamW``'s single-tensor (``foreach=False``) path with
    amsgrad and maximize off:

    1. only when ``weight_decay != 0`` (and only for ``W``):
       Adam (Kingma & Ba 2015, L2 folded into the gradient): ``g = g + wd * W``;
       AdamW (Loshchilov & Hutter 2019, decoupled): ``W = W * (1 - lr * wd)``;
    2. ``m = m + (1 - b1) * (g - m)``: ``torch.lerp(m, g, 1 - b1)``, which is
       ``b1 m + (1 - b1) g``; for ``1 - b1 >= 0.5`` lerp's other branch,
       ``g - (g - m) * (1 - (1 - b1))``;
    3. ``v = v * b2 + ((1 - b2) * g) * g``: ``v.mul_(b2).addcmul_(g, g, value=1 - b2)``;
    4. ``bias_correction1 = 1 - b1 ** t``, ``bias_correction2 = 1 - b2 ** t`` (floats);
    5. ``step_size = lr / bias_correction1``;
    6. ``denom = sqrt(v) / bias_correction2 ** 0.5 + eps``;
    7. ``W = W + ((-step_size) * m) / denom``: ``W.addcdiv_(m, denom, value=-step_size)``.

    That is Algorithm 1's ``W - lr * m_hat / (sqrt(v_hat) + eps)`` with ``eps`` added to
    ``sqrt(v) / sqrt(bias_correction2)``, as PyTorch does. PyTorch's vectorised CPU
    kernels fuse some multiply-adds (lerp, ``add(alpha=)``, at times addcmul), which
    NumPy rounds twice, so the two can differ in the last bits (about 1e-16 in float64).
    """
    b1, b2 = float(betas[0]), float(betas[1])
    step = float(step)
    new_p, new_s = [], []
    for (W, b), (gW, gb), st in zip(params, grads, state):
        sW, sb = (None, None) if st is None else st
        W, sW = _adam_tensor(W, gW, sW, lr, b1, b2, eps, weight_decay, decoupled, step)
        if b is not None:
            b, sb = _adam_tensor(b, gb, sb, lr, b1, b2, eps, 0.0, decoupled, step)
        else:
            sb = None
        new_p.append((W, b))
        new_s.append((sW, sb))
    return new_p, new_s


# ----------------------------------------------------------------------- CNNs
# Whole-batch NumPy definitions through ``sliding_window_view`` (not the im2col
# kernels of the engine). Images are NCHW; Flatten is (C, H, W) order.


def _windows(xpad, kh, kw, s):
    from numpy.lib.stride_tricks import sliding_window_view

    return sliding_window_view(xpad, (kh, kw), axis=(2, 3))[:, :, ::s, ::s]


def _conv_fwd(x, W, b, s, pad, groups):
    t, bo, l, r = pad
    win = _windows(np.pad(x, ((0, 0), (0, 0), (t, bo), (l, r))), W.shape[2], W.shape[3], s)
    o, cg = W.shape[0], W.shape[1]
    og = o // groups
    y = np.concatenate([np.einsum("ncpqij,ocij->nopq", win[:, g * cg:(g + 1) * cg],
                                  W[g * og:(g + 1) * og]) for g in range(groups)], axis=1)
    return y if b is None else y + b[None, :, None, None]


def _conv_bwd(x, W, dz, s, pad, groups, bias):
    t, bo, l, r = pad
    xpad = np.pad(x, ((0, 0), (0, 0), (t, bo), (l, r)))
    kh, kw = W.shape[2], W.shape[3]
    win = _windows(xpad, kh, kw, s)
    o, cg = W.shape[0], W.shape[1]
    og = o // groups
    dW = np.concatenate([np.einsum("nopq,ncpqij->ocij", dz[:, g * og:(g + 1) * og],
                                   win[:, g * cg:(g + 1) * cg]) for g in range(groups)], axis=0)
    dwin = np.concatenate([np.einsum("ocij,nopq->ncpqij", W[g * og:(g + 1) * og],
                                     dz[:, g * og:(g + 1) * og]) for g in range(groups)], axis=1)
    dxpad = np.zeros_like(xpad)
    oh, ow = dz.shape[2], dz.shape[3]
    for i in range(kh):
        for j in range(kw):
            dxpad[:, :, i:i + s * (oh - 1) + 1:s, j:j + s * (ow - 1) + 1:s] += dwin[..., i, j]
    h, w = x.shape[2], x.shape[3]
    return dxpad[:, :, t:t + h, l:l + w], dW, (dz.sum(axis=(0, 2, 3)) if bias else None)


def _pool_fwd(x, k, s, pad, mode):
    t, bo, l, r = pad
    fill = -np.inf if mode == "max" else 0.0
    xpad = np.pad(x, ((0, 0), (0, 0), (t, bo), (l, r)), constant_values=fill)
    win = _windows(xpad, k, k, s)
    if mode == "max":
        return win.max(axis=(4, 5))
    ones = np.pad(np.ones((1, 1) + x.shape[2:]), ((0, 0), (0, 0), (t, bo), (l, r)))
    return win.sum(axis=(4, 5)) / _windows(ones, k, k, s).sum(axis=(4, 5))


def _pool_bwd(x, dy, k, s, pad, mode):
    t, bo, l, r = pad
    fill = -np.inf if mode == "max" else 0.0
    xpad = np.pad(x, ((0, 0), (0, 0), (t, bo), (l, r)), constant_values=fill)
    n, c, oh, ow = dy.shape
    dxpad = np.zeros_like(xpad)
    if mode == "max":  # the first maximum of each window (row-major) takes the gradient
        win = _windows(xpad, k, k, s).reshape(n, c, oh, ow, k * k)
        first = win.argmax(axis=4)
        for p in range(oh):
            for q in range(ow):
                i, j = np.divmod(first[:, :, p, q], k)
                nn, cc = np.meshgrid(np.arange(n), np.arange(c), indexing="ij")
                np.add.at(dxpad, (nn, cc, p * s + i, q * s + j), dy[:, :, p, q])
    else:
        ones = np.pad(np.ones((1, 1) + x.shape[2:]), ((0, 0), (0, 0), (t, bo), (l, r)))
        share = dy / _windows(ones, k, k, s).sum(axis=(4, 5))
        for i in range(k):
            for j in range(k):
                dxpad[:, :, i:i + s * (oh - 1) + 1:s, j:j + s * (ow - 1) + 1:s] += share
    h, w = x.shape[2], x.shape[3]
    return dxpad[:, :, t:t + h, l:l + w]


def cnn_loss_and_grads(layers, params, X, y):
    """Loss, accuracy, logits ``(B, classes)`` and gradients ``[(dW, db), ...]`` of a CNN.

    ``layers``: the model's layer descriptions (dask_ipar Conv2d, MaxPool2d, AvgPool2d,
    Flatten, Dense); ``params``: ``(W, b)`` of every layer with weights, in order (conv
    ``W`` is ``(O, C/groups, kh, kw)``); ``X``: images ``(B, C, H, W)``; ``y``: labels.
    """
    from dask_ipar.nn.layers import Conv2d, Dense, Flatten, resolve_padding

    a, cache, it = X, [], iter(params)
    for lay in layers:
        if isinstance(lay, Conv2d):
            W, b = next(it)
            pad = resolve_padding(lay.padding, a.shape[2:], lay.kernel_size,
                                  (lay.stride, lay.stride))
            z = _conv_fwd(a, W, b, lay.stride, pad, lay.groups)
            cache.append((a, z, pad))
            a = _act(z, lay.activation)
        elif isinstance(lay, Flatten):
            cache.append((a, None, None))
            a = a.reshape(a.shape[0], -1).T
        elif isinstance(lay, Dense):
            W, b = next(it)
            z = W @ a + (b[:, None] if b is not None else 0)
            cache.append((a, z, None))
            a = _act(z, lay.activation)
        else:
            k, s = lay.kernel_size, lay.stride
            pad = resolve_padding(lay.padding, a.shape[2:], (k, k), (s, s))
            cache.append((a, None, pad))
            a = _pool_fwd(a, k, s, pad, lay.mode)
    logits = a
    loss, acc, d = _softmax_xent(logits, y)
    grads = []
    wi = len(params)
    for lay, (x, z, pad) in zip(layers[::-1], cache[::-1]):
        if isinstance(lay, Dense):
            wi -= 1
            W, b = params[wi]
            d = d * _act_grad(z, lay.activation)
            grads.append((d @ x.T, d.sum(axis=1) if b is not None else None))
            d = W.T @ d
        elif isinstance(lay, Flatten):
            d = d.T.reshape(x.shape)
        elif isinstance(lay, Conv2d):
            wi -= 1
            W, b = params[wi]
            d = d * _act_grad(z, lay.activation)
            d, dW, db = _conv_bwd(x, W, d, lay.stride, pad, lay.groups, b is not None)
            grads.append((dW, db))
        else:
            d = _pool_bwd(x, d, lay.kernel_size, lay.stride, pad, lay.mode)
    return loss, acc, logits.T, grads[::-1]


def clip_grads(grads, max_norm):
    """Gradients ``[(dW, db), ...]`` scaled to global 2-norm at most ``max_norm`` (over
    every array), as ``torch.nn.utils.clip_grad_norm_``: the factor ``min(1, max_norm /
    (norm + 1e-6))``. Returns ``(clipped, norm)``."""
    norm = float(np.sqrt(sum(float(np.sum(g * g)) for pair in grads for g in pair
                             if g is not None)))
    f = min(1.0, max_norm / (norm + 1e-6))
    return [tuple(None if g is None else g * f for g in pair) for pair in grads], norm
