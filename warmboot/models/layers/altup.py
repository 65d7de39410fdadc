"""Gemma 3n's pieces around its decoder layers: AltUp (several copies of the hidden state,
predicted from each other and corrected by the layer's output), LAuReL (a low-rank residual
branch), the Gaussian top-k cut of gate activations, the magnitude-matched projections that
make and merge the copies, and its RMSNorm (scaled in float32, an unscaled variant)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from warmboot.models.layers.activation import GatedMLP
from warmboot.models.layers.linear import Linear


@functools.cache
def _rounded(value: float, dtype: torch.dtype) -> float:
    """``value`` as float32 holds it, then as ``dtype`` does (transformers keeps such scales
    as float32 tensors and casts them to the activations' dtype)."""
    return torch.tensor(value, dtype=torch.float32, device="cpu").to(dtype).item()


class Gemma3nRMSNorm(nn.Module):
    """``x * (mean(x^2) + eps) ** -0.5``, times ``weight`` (none: ``with_scale=False``), all in
    float32, then cast back."""

    def __init__(self, size: int, eps: float, with_scale: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size)) if with_scale else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            xf = xf * self.weight.float()
        return xf.to(x.dtype)


class Laurel(nn.Module):
    """LAuReL: ``x + norm(right(left(x)))``, ``left`` down to ``rank``."""

    def __init__(self, hidden: int, rank: int, eps: float):
        super().__init__()
        self.linear_left = Linear(hidden, rank)
        self.linear_right = Linear(rank, hidden)
        self.post_laurel_norm = Gemma3nRMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.post_laurel_norm(self.linear_right(self.linear_left(x)))


class SparseGatedMLP(GatedMLP):
    """A gated MLP whose gate activations are cut first where ``sparsity`` > 0: ``relu(g -
    (mean(g) + std(g) * icdf(sparsity)))`` per token (std over the row, biased), keeping about
    the top ``1 - sparsity`` of a Gaussian row."""

    def __init__(self, hidden: int, intermediate: int, act: str, sparsity: float):
        super().__init__(hidden, intermediate, act)
        self.sparsity = float(sparsity)
        cpu = dict(dtype=torch.float32, device="cpu")  # NOTE: models are built on meta
        normal = torch.distributions.Normal(torch.tensor(0.0, **cpu), torch.tensor(1.0, **cpu))
        icdf = normal.icdf(torch.tensor(self.sparsity, **cpu))
        self.std_multiplier = float(icdf)
        """The standard normal's quantile at ``sparsity``, in float32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sparsity <= 0.0:
            return super().forward(x)
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        mean = gate.mean(-1, keepdim=True)
        std = torch.std(gate, dim=-1, keepdim=True, unbiased=False)
        cutoff = mean + std * _rounded(self.std_multiplier, gate.dtype)
        return self.down_proj(self.act(F.relu(gate - cutoff)) * up)


class AltUp(nn.Module):
    """AltUp over ``n`` copies of the hidden state, held as (N, n, H). ``predict`` mixes the
    copies with per-token coefficients routed from the active copy; ``correct`` adds the
    layer's innovation (its output less the active prediction) to every copy, each scaled by
    its own routed coefficient plus one."""

    def __init__(self, hidden: int, n: int, active: int, eps: float):
        super().__init__()
        self.n, self.active = n, active
        self.correct_output_scale = nn.Parameter(torch.empty(hidden))
        self.correction_coefs = Linear(n, n)
        self.prediction_coefs = Linear(n, n * n)
        self.modality_router = Linear(hidden, n)
        self.router_norm = Gemma3nRMSNorm(hidden, eps)
        self.router_scale = hidden**-1.0

    def modalities(self, x: torch.Tensor) -> torch.Tensor:
        """(N, H) -> (N, n): ``tanh(router(norm(x) / H))``, the tanh in float32."""
        routed = self.modality_router(self.router_norm(x) * _rounded(self.router_scale, x.dtype))
        return torch.tanh(routed.float()).to(x.dtype)

    def predict(self, copies: torch.Tensor) -> torch.Tensor:
        """(N, n, H) -> (N, n, H): copy ``a`` plus the sum over ``b`` of ``c[a, b]`` times
        copy ``b``, ``c`` routed from the active copy."""
        coefs = self.prediction_coefs(self.modalities(copies[:, self.active]))
        coefs = coefs.reshape(-1, self.n, self.n)
        return (copies + torch.bmm(coefs, copies)).to(copies.dtype)

    def correct(self, predictions: torch.Tensor, activated: torch.Tensor) -> torch.Tensor:
        """(N, n, H) predictions, (N, H) layer output -> (N, n, H) corrected copies."""
        coefs = self.correction_coefs(self.modalities(activated)) + 1.0
        innovation = activated - predictions[:, self.active]
        return (innovation[:, None, :] * coefs[:, :, None] + predictions).to(activated.dtype)

    def scale_output(self, x: torch.Tensor) -> torch.Tensor:
        """The corrected active copy times ``correct_output_scale`` (in the weight's dtype)."""
        scale = self.correct_output_scale
        return (x.to(scale.dtype) * scale).to(x.dtype)


def matched(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``x`` rescaled to ``target``'s root-mean-square per row (``x``'s own clamped below at
    1e-5 before its square root)."""
    size = torch.sqrt(torch.mean(x**2, dim=-1, keepdim=True).clamp(min=1e-5))
    return x * target / size


def rms(x: torch.Tensor) -> torch.Tensor:
    return torch.mean(x**2, dim=-1, keepdim=True) ** 0.5


def expand_copies(projections: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    """(N, H) embedding -> (N, n, H) copies: the embedding, then each of ``projections``
    (``altup_projections``) of it at its magnitude."""
    target = rms(x)
    return torch.stack([x, *(matched(p(x), target) for p in projections)], dim=1)


def merge_copies(projections: nn.ModuleList, copies: torch.Tensor) -> torch.Tensor:
    """(N, n, H) copies -> (N, H): the mean of copy 0 and of ``projections[i-1]``
    (``altup_unembed_projections``) of each copy ``i`` at copy 0's magnitude."""
    first = copies[:, 0]
    target = rms(first)
    made = (matched(p(copies[:, i + 1]), target) for i, p in enumerate(projections))
    return torch.stack([first, *made], dim=0).mean(dim=0)
