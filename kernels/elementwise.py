"""Elementwise device functions that kernels share, written with Triton's portable ops only.

libdevice's functions (``tanh``, ``pow`` ...) fail under Triton's interpreter, so a kernel that must
run on a CPU writes them from ``tl.exp`` and arithmetic. How it writes them decides their accuracy:
the tempting ``tanh(u) = 2 sigmoid(2u) - 1`` subtracts two numbers near 1 when ``u`` is small and
keeps only the absolute precision of 1 (about 6e-8), a relative error of about 6e-8 / u: 2e-6 at
u = 0.03 (a logit of 1 under Gemma 2's cap of 30), where ``torch.tanh`` in fp32 is within 6e-8.
:func:`tanh` has no such cancellation (``tests/test_loss.py`` checks it against float64).
"""
from __future__ import annotations

import triton
import triton.language as tl

# Below this |u| the odd Taylor polynomial (9 terms, to u^17) is used: its truncation error there is
# under 1e-9 relative, below fp32's rounding. Above it the exponential form has no cancellation.
TANH_POLY_LIMIT = tl.constexpr(0.55)


@triton.jit
def tanh(u):
    """tanh(u) in fp32, with no cancellation near 0 (a drop-in for libdevice's tanh).

    |u| < 0.55:  tanh u = u (1 + u^2 P(u^2)), the Taylor series 1 - u^2/3 + 2u^4/15 - 17u^6/315 ...
                 in Horner form: every step adds a term smaller than the running sum, so the
                 relative error stays at fp32's rounding however small u is.
    |u| >= 0.55: tanh |u| = 1 - 2t / (1 + t), t = exp(-2|u|) <= 0.33: 2t / (1 + t) <= 0.5, so the
                 subtraction from 1 cancels nothing; t underflows to 0 for large |u| (tanh = 1 exactly).
    The sign is restored at the end (tanh is odd); NaN stays NaN, +-inf gives +-1, +-0 gives 0.
    """
    a = tl.abs(u)
    a2 = u * u
    p = -0.00023912911424355248 * a2 + 0.000590027440945586     # -443861162/1856156927625, 6404582/10854718875
    p = p * a2 - 0.0014558343870513183                           # -929569/638512875
    p = p * a2 + 0.003592128036572481                            # 21844/6081075
    p = p * a2 - 0.008863235529902197                            # -1382/155925
    p = p * a2 + 0.021869488536155203                            # 62/2835
    p = p * a2 - 0.05396825396825397                             # -17/315
    p = p * a2 + 0.13333333333333333                             # 2/15
    p = p * a2 - 0.3333333333333333                              # -1/3
    small = u + u * (p * a2)                                     # u (1 + u^2 P(u^2))
    t = tl.exp(-2.0 * a)                                         # in (0, 0.33] on this branch
    large = 1.0 - 2.0 * t / (1.0 + t)                            # tanh |u|
    large = tl.where(u < 0, -large, large)
    return tl.where(a < TANH_POLY_LIMIT, small, large)
