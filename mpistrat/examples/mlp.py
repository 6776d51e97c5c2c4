"""A multi-layer perceptron classifier with hand-written backprop, for NumPy or CuPy arrays.

The parameters are a flat list ``[W1, b1, W2, b2, ...]``; hidden layers use ReLU and the
loss is softmax cross-entropy. Every function works on whichever array module its inputs
come from, so the same code trains on the CPU (NumPy) or a GPU (CuPy).

>>> import numpy as np
>>> params = init_params([4, 8, 3], np.random.default_rng(0))
>>> [p.shape for p in params]
[(4, 8), (8,), (8, 3), (3,)]
>>> x, labels = np.ones((5, 4)), np.array([0, 1, 2, 0, 1])
>>> losses, grads = loss_and_grads(params, x, labels)
>>> losses.shape, [g.shape for g in grads] == [p.shape for p in params]
((5,), True)
"""

from __future__ import annotations

import itertools
from types import ModuleType
from typing import Any

import numpy as np

__all__ = ["array_module", "init_params", "logits", "loss_and_grads", "predict"]


def array_module(x: Any) -> ModuleType:
    """``cupy`` for CuPy arrays, else ``numpy``."""
    if type(x).__module__.startswith("cupy"):
        import cupy

        return cupy
    return np


def init_params(sizes: list[int], rng: np.random.Generator, dtype: Any = np.float64) -> list[np.ndarray]:
    """He-initialised weights and zero biases for layers of the given sizes (NumPy arrays)."""
    params = []
    for fan_in, fan_out in itertools.pairwise(sizes):
        params.append((rng.standard_normal((fan_in, fan_out)) * np.sqrt(2.0 / fan_in)).astype(dtype))
        params.append(np.zeros(fan_out, dtype=dtype))
    return params


def _forward(params: list[Any], x: Any) -> tuple[Any, list[Any]]:
    xp = array_module(x)
    inputs = [x]  # the input of each layer, kept for the backward pass
    h = x
    for i in range(0, len(params), 2):
        z = h @ params[i] + params[i + 1]
        if i + 2 < len(params):
            h = xp.maximum(z, 0)
            inputs.append(h)
        else:
            h = z
    return h, inputs


def loss_and_grads(params: list[Any], x: Any, labels: Any) -> tuple[Any, list[Any]]:
    """Per-example cross-entropy losses and the gradients of their **sum** w.r.t. ``params``.

    Works on an empty batch too (zero losses, zero gradients), as a replica may get one.
    """
    xp = array_module(x)
    logits, inputs = _forward(params, x)
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_z = xp.log(xp.exp(shifted).sum(axis=1))
    rows = xp.arange(len(x))
    losses = log_z - shifted[rows, labels]
    delta = xp.exp(shifted - log_z[:, None])  # softmax
    delta[rows, labels] -= 1
    grads: list[Any] = [None] * len(params)
    for i in range(len(params) - 2, -1, -2):
        grads[i] = inputs[i // 2].T @ delta
        grads[i + 1] = delta.sum(axis=0)
        if i:
            delta = (delta @ params[i].T) * (inputs[i // 2] > 0)
    return losses, grads


def logits(params: list[Any], x: Any) -> Any:
    """The unnormalised class scores of each row of ``x``."""
    return _forward(params, x)[0]


def predict(params: list[Any], x: Any) -> Any:
    """The predicted class of each row of ``x``."""
    logits, _ = _forward(params, x)
    return logits.argmax(axis=1)
