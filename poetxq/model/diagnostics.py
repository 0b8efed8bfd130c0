"""Training diagnostics of POET layers: what the POET paper (arXiv 2506.08001, §3–4) says stays
fixed in exact arithmetic, measured on the layers we actually train.

In exact POET the effective weight ``W = R · W0 · P`` keeps ``W0``'s singular values (only the
singular vectors move), so the neurons' hyperspherical energy stays near its value at the
normalized Gaussian initialization, and each neuron's cosine to its initial direction traces the
paper's three phases. In poetxq ``R`` and ``P`` come from a truncated Cayley–Neumann series
(orthogonal only up to ``O(‖Q‖^(k+1))``) and ``W0`` is re-quantized at every merge, so each of
these drifts a little; the functions here measure by how much:

- :func:`spectrum_drift`: the largest change of a singular value, relative to the largest one.
- :func:`orthogonality_error`: ``max_k ‖G_kᵀ G_k − I‖₂`` over the CNP blocks ``G_k``.
- :func:`hyperspherical_energy`: the mean inverse distance between unit neurons (Riesz s = 1).
- :func:`direction_cosines`: per neuron, the cosine between its current and initial weights.
- :class:`LayerDiagnostics`: all four for one :class:`poetxq.model.layer.POETXLinear` against
  the state it had when tracking started (a fixed sample of neurons, so a 14336-row layer costs
  a 512 × 512 Gram matrix, not 14336²).

Everything runs under ``torch.no_grad()``, nothing here changes a layer. The SVDs run in float32
on the layer's device (:class:`LayerDiagnostics`); the drifts, orthogonality errors, energies
and cosines are computed in float64 from them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from poetxq.model.layer import POETXLinear

__all__ = [
    "DIAG_KEYS",
    "REQUANT_KEY",
    "LayerDiagnostics",
    "direction_cosines",
    "hyperspherical_energy",
    "orthogonality_error",
    "quantiles",
    "spectrum_drift",
    "summarize_layers",
]

#: ``sigma_drift_w0`` above this earns a run one note: the weights' singular values, which exact
#: POET keeps, moved by more than 5 % of the largest within one merge period, so the CNP series is
#: used far outside its accurate range (a rotation lr too high for ``k`` Neumann terms). Not the
#: blocks' ``orth_error``: the embedded default recipe reaches 0.05 there while its spectrum moves
#: 0.2 % (evals/results/diagnostics_tiny_cpu.json)
DRIFT_WARNING = 0.05

#: the keys of a :func:`summarize_layers` record (``metrics.jsonl`` of a run with
#: ``train.diagnostics_every``)
DIAG_KEYS = (
    "diag_sigma_drift_init",
    "diag_sigma_drift_w0",
    "diag_orth_error",
    "diag_energy",
    "diag_cos_min",
    "diag_cos_median",
)

#: the key of the record a run with ``train.diagnostics_every`` logs after each merge: the worst
#: layer's ``W0`` re-quantization error ``‖W0_new − W‖_F / ‖W‖_F``
#: (:meth:`poetxq.model.layer.POETXLinear.merge_then_reinitialize`)
REQUANT_KEY = "diag_requant_error"

#: the quantiles :func:`quantiles` reports (min, 5 %, median, 95 %, max)
QUANTILES = (0.0, 0.05, 0.5, 0.95, 1.0)


def _unit_rows(w: torch.Tensor) -> torch.Tensor:
    w = w.detach().to(torch.float64)
    norms = w.norm(dim=1, keepdim=True)
    if bool((norms == 0).any()):
        raise ValueError("a neuron (row) of the weight is all zeros; its direction is undefined")
    return w / norms


def spectrum_drift(sigma: torch.Tensor, sigma_ref: torch.Tensor) -> float:
    """``max_i |σ_i − σ_ref,i| / max_i σ_ref,i``: how far a weight's singular values moved.

    Args:
        sigma: singular values ``[r]`` (any float dtype), as ``torch.linalg.svdvals`` returns
            them (descending).
        sigma_ref: the reference's ``[r]``.

    Returns:
        The largest absolute change relative to the reference's largest singular value (0 for
        an exactly orthogonal ``R``, ``P`` and no re-quantization; relative to the largest so
        that near-zero singular values do not dominate).

    Raises:
        ValueError: shapes differ, or the reference is all zeros.
    """
    if sigma.shape != sigma_ref.shape:
        raise ValueError(f"singular values {tuple(sigma.shape)} vs {tuple(sigma_ref.shape)}")
    s, r = sigma.to(torch.float64), sigma_ref.to(torch.float64)
    top = r.max()
    if top <= 0:
        raise ValueError("the reference weight is zero; its spectrum drift is undefined")
    return float((s - r).abs().max() / top)


def orthogonality_error(blocks: torch.Tensor) -> float:
    """``max_k ‖G_kᵀ G_k − I‖₂`` over orthogonal blocks ``G [nb, b, b]`` (spectral norm:
    ``max |σ(G_k)² − 1|``, so 1e-3 means a singular value off by about 5e-4).

    Raises:
        ValueError: ``blocks`` is not ``[nb, b, b]``.
    """
    if blocks.dim() != 3 or blocks.shape[1] != blocks.shape[2]:
        raise ValueError(f"expected blocks [nb, b, b], got {tuple(blocks.shape)}")
    g = blocks.detach().to(torch.float64)
    eye = torch.eye(g.shape[1], dtype=torch.float64, device=g.device)
    return float(torch.linalg.matrix_norm(g.transpose(1, 2) @ g - eye, ord=2).max())


def hyperspherical_energy(w: torch.Tensor) -> float:
    """Mean over ordered pairs ``i ≠ j`` of ``1 / ‖ŵ_i − ŵ_j‖`` for the unit rows ``ŵ`` of
    ``w [m, n]`` (the POET paper's hyperspherical energy with power s = 1, averaged so layers
    of different widths compare; i.i.d. Gaussian rows in high dimension give about ``1/√2``).

    Raises:
        ValueError: fewer than two rows, or a zero row.
    """
    if w.dim() != 2 or w.shape[0] < 2:
        raise ValueError(f"expected a weight [m >= 2, n], got {tuple(w.shape)}")
    u = _unit_rows(w)
    m = u.shape[0]
    # ‖ŵ_i − ŵ_j‖² = 2 − 2 cos; clamp: two equal rows have infinite energy, reported as such
    dist = (2.0 - 2.0 * (u @ u.t())).clamp_min(0.0).sqrt()
    off = ~torch.eye(m, dtype=torch.bool, device=u.device)
    return float((1.0 / dist[off]).mean())


def direction_cosines(w: torch.Tensor, w_init: torch.Tensor) -> torch.Tensor:
    """Per neuron, ``cos(w_i, w_init,i)`` ``[m]`` float64 for weights ``[m, n]``.

    Raises:
        ValueError: shapes differ, or a row is zero.
    """
    if w.shape != w_init.shape:
        raise ValueError(f"weights {tuple(w.shape)} vs initial {tuple(w_init.shape)}")
    return (_unit_rows(w) * _unit_rows(w_init)).sum(dim=1)


def quantiles(values: torch.Tensor, qs: tuple[float, ...] = QUANTILES) -> list[float]:
    """``torch.quantile`` of ``values`` at ``qs`` (linear interpolation), as Python floats.

    ``values`` may live on any device; it is copied to the CPU (``torch.quantile`` needs the
    ``q`` tensor on the input's device, and the result is a handful of floats anyway).
    """
    v = values.detach().to("cpu", torch.float64).flatten()
    return [float(x) for x in torch.quantile(v, torch.tensor(qs, dtype=torch.float64))]


class LayerDiagnostics:
    """The diagnostics of one POET layer against the state it had at construction.

    At construction it keeps the effective weight's singular values ``[min(m, n)]`` and the
    initial weights of ``sample`` neurons (rows drawn once from ``generator``; all rows when
    the layer has fewer), float64 on the layer's device. :meth:`measure` then reports, for
    the layer as it is now:

    - ``sigma_drift_init``: :func:`spectrum_drift` of ``R · W0 · P`` against the start (all
      merges and re-quantizations since, accumulated);
    - ``sigma_drift_w0``: the same against the current stored ``W0`` (the drift of this merge
      period alone: CNP truncation);
    - ``orth_error``: :func:`orthogonality_error` over both sides' blocks;
    - ``energy``: :func:`hyperspherical_energy` of the sampled neurons;
    - ``cos``: :func:`quantiles` of the sampled neurons' :func:`direction_cosines`.

    Cost per call: two SVDs of ``[m, n]`` (float32 on the layer's device), one CNP of each side,
    a ``sample × sample`` Gram matrix.
    """

    def __init__(
        self, layer: POETXLinear, *, sample: int = 512, generator: torch.Generator | None = None
    ) -> None:
        if sample < 2:
            raise ValueError(f"sample={sample}: need at least two neurons")
        self.layer = layer
        m = layer.out_features
        with torch.no_grad():
            w = layer.effective_weight(torch.float32)
            self.sigma_init = torch.linalg.svdvals(w).to(torch.float64)
            if m <= sample:
                rows = torch.arange(m)
            else:
                rows = torch.randperm(m, generator=generator)[:sample].sort().values
            self.rows = rows.to(w.device)
            self.w_init = w[self.rows].to(torch.float64)

    @torch.no_grad()
    def measure(self) -> dict[str, float | list[float]]:
        """The layer's diagnostics now (keys in the class docstring); floats, ``cos`` a list
        of the :data:`QUANTILES`."""
        layer = self.layer
        w = layer.effective_weight(torch.float32)
        sigma = torch.linalg.svdvals(w)
        sigma_w0 = torch.linalg.svdvals(layer.stored_w0(torch.float32))
        orth = max(orthogonality_error(layer.P.blocks()), orthogonality_error(layer.R.blocks()))
        sampled = w[self.rows]
        return {
            "sigma_drift_init": spectrum_drift(sigma, self.sigma_init),
            "sigma_drift_w0": spectrum_drift(sigma, sigma_w0),
            "orth_error": orth,
            "energy": hyperspherical_energy(sampled),
            "cos": quantiles(direction_cosines(sampled, self.w_init)),
        }


def summarize_layers(measures: list[dict[str, float | list[float]]]) -> dict[str, float]:
    """One record for ``metrics.jsonl`` from :meth:`LayerDiagnostics.measure` of every layer:
    the worst layer's ``sigma_drift_init``, ``sigma_drift_w0`` and ``orth_error`` (max), the mean
    ``energy``, the lowest neuron cosine (``cos_min``) and the median of the layers' median
    cosines (``cos_median``), each key prefixed ``diag_``.

    Raises:
        ValueError: ``measures`` is empty.
    """
    if not measures:
        raise ValueError("no POET layer to summarize")

    def col(key: str) -> list[float]:
        return [float(m[key]) for m in measures]  # type: ignore[arg-type]

    cos = [list(m["cos"]) for m in measures]  # type: ignore[call-overload]
    medians = sorted(c[2] for c in cos)
    return {
        "diag_sigma_drift_init": max(col("sigma_drift_init")),
        "diag_sigma_drift_w0": max(col("sigma_drift_w0")),
        "diag_orth_error": max(col("orth_error")),
        "diag_energy": sum(col("energy")) / len(measures),
        "diag_cos_min": min(c[0] for c in cos),
        "diag_cos_median": medians[len(medians) // 2],
    }
