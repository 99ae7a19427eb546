"""The optimizer rules modelled in numpy float32, one IEEE operation at a time in the order
csrc/row_ops.h runs them, with the C library's fmaf for its fused multiply-adds: every operation is
correctly rounded on every CPU, so the rules must equal this model to the bit wherever they run
(torch's own optimizers round differently from one CPU capability to another)."""
from __future__ import annotations

import ctypes
import ctypes.util
import math

import numpy as np

_libm = ctypes.CDLL(ctypes.util.find_library("m"))
_libm.fmaf.restype = ctypes.c_float
_libm.fmaf.argtypes = [ctypes.c_float, ctypes.c_float, ctypes.c_float]
_fmaf = np.frompyfunc(lambda a, b, c: _libm.fmaf(a, b, c), 3, 1)

f32 = np.float32


def fmaf(a, b, c) -> np.ndarray:
    """a * b + c rounded once, elementwise (broadcast), as float32."""
    a, b, c = np.broadcast_arrays(f32(a), f32(b), f32(c))
    return _fmaf(a, b, c).astype(f32)


def sgd(lr, weights, state, grads, step):
    return fmaf(-f32(lr), grads, weights), state


def adagrad(lr, eps, weights, state, grads, step):
    state = fmaf(grads, grads, state)
    return weights - f32(lr) * grads / (np.sqrt(state) + f32(eps)), state


def rowwise_adagrad(lr, eps, weights, state, grads, step):
    dim = grads.shape[1]
    squares = np.zeros(len(grads), dtype=f32)
    for j in range(dim):  # summed element after element, as the rule does
        squares = squares + grads[:, j] * grads[:, j]
    state = state[:, 0] + squares / f32(dim)
    scale = f32(lr) / (np.sqrt(state) + f32(eps))
    return weights - grads * scale[:, None], state[:, None]


def adam(lr, betas, eps, weights, state, grads, step):
    beta1, beta2 = f32(betas[0]), f32(betas[1])
    # The step size in double, as SparseAdam computes it, then float.
    b1, b2 = float(beta1), float(beta2)
    scale = f32(-(float(f32(lr)) * math.sqrt(1.0 - b2 ** step) / (1.0 - b1 ** step)))
    dim = grads.shape[1]
    exp_avg, exp_avg_sq = state[:, :dim], state[:, dim:]
    exp_avg = exp_avg + (grads - exp_avg) * (f32(1) - beta1)
    exp_avg_sq = exp_avg_sq + (grads * grads - exp_avg_sq) * (f32(1) - beta2)
    denom = np.sqrt(exp_avg_sq) + f32(eps)
    return weights + scale * (exp_avg / denom), np.concatenate([exp_avg, exp_avg_sq], axis=1)
