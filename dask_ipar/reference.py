"""Single-process NumPy reference of the models dask-ipar trains.

Written directly from the definitions with whole matrices, sharing no code
with the distributed engine, so that tests can compare the two. Layout:
``W`` is ``d_out x d_in``, ``X`` is ``d_in x B`` (one column per sample),
loss is the mean softmax cross-entropy, and SGD is PyTorch's (momentum
buffer ``v = mu v + g + wd W``; weight decay not applied to biases).
"""

from __future__ import annotations

import numpy as np

__all__ = ["mlp_forward", "mlp_loss_and_grads", "sgd_step"]


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


def mlp_loss_and_grads(params, activations, X, y):
    """Mean cross-entropy loss, accuracy and gradients ``[(dW, db), ...]``."""
    logits, xs, zs = mlp_forward(params, activations, X)
    B = X.shape[1]
    m = logits.max(axis=0, keepdims=True)
    lse = np.log(np.exp(logits - m).sum(axis=0)) + m[0]
    loss = float(np.mean(lse - logits[y, np.arange(B)]))
    acc = float(np.mean(logits.argmax(axis=0) == y))
    p = np.exp(logits - lse[None, :])
    dz = p.copy()
    dz[y, np.arange(B)] -= 1
    dz /= B
    grads = [None] * len(params)
    for k in range(len(params) - 1, -1, -1):
        W, b = params[k]
        dz = dz * _act_grad(zs[k], activations[k])
        grads[k] = (dz @ xs[k].T, dz.sum(axis=1) if b is not None else None)
        dz = W.T @ dz
    return loss, acc, grads


def sgd_step(params, velocity, grads, lr, momentum=0.0, weight_decay=0.0):
    """One SGD step in place of new lists; ``velocity`` entries may be None at first."""
    new_p, new_v = [], []
    for (W, b), (gW, gb), v in zip(params, grads, velocity):
        gW = gW + weight_decay * W
        if v is None:
            vW, vb = gW, gb
        else:
            vW = momentum * v[0] + gW
            vb = None if gb is None else momentum * v[1] + gb
        new_p.append((W - lr * vW, None if b is None else b - lr * vb))
        new_v.append((vW, vb))
    return new_p, new_v
