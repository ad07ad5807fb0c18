"""The cost model's terms from measurements, by least squares.

Two regressions, each on what isolates its terms (docs/CALIBRATE.md):

- decode: the time between two tokens of a stream while every sequence in
  the batch decodes is one engine step, `t0 + c_d*D + c_kv*K` (D sequences,
  K their context tokens);
- prefill: the first token of a lone request is its prefill step,
  `t0 + c_p*P + c_q*P^2` plus what the client and the network add (one
  constant, the intercept's excess over t0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class DecodeSample:
    seqs: int
    """Sequences decoding together (D)."""
    context_tokens: float
    """Their context, prompt + generated so far, all together (K)."""
    step_ms: float
    """Measured time between two tokens."""


@dataclass(frozen=True, slots=True)
class PrefillSample:
    prompt_tokens: int
    ttft_ms: float
    """Measured time to the first token of a request alone in the engine."""


@dataclass(frozen=True, slots=True)
class Term:
    name: str
    value: float
    stderr: float
    """The least-squares standard error of the value."""


@dataclass(frozen=True, slots=True)
class Regression:
    terms: tuple[Term, ...]
    rms_ms: float
    """Root mean square of the residuals (measured - fitted), in ms."""
    samples: int

    def value(self, name: str) -> float:
        return next(term.value for term in self.terms if term.name == name)


def _least_squares(columns: dict[str, np.ndarray], y: np.ndarray) -> Regression:
    """y ~ sum of value * column, no value below 0: a negative one (a term too
    small to see under the noise) is dropped and the rest fitted again."""
    names = list(columns)
    while True:
        x = np.column_stack([columns[name] for name in names])
        # Columns run from 1 to ~10^6 (K, P^2): scaled to one size, the
        # system stays well conditioned.
        scale = np.abs(x).max(axis=0)
        scale[scale == 0] = 1.0
        coef, *_ = np.linalg.lstsq(x / scale, y, rcond=None)
        coef = coef / scale
        # The first term (the fixed cost) goes last: only when it alone is
        # negative, and then the others take the whole time.
        negative = [n for n, c in zip(names, coef) if c < 0 and n != names[0]]
        if not negative and coef[0] < 0 and len(names) > 1:
            negative = [names[0]]
        if not negative:
            break
        names.remove(min(negative, key=lambda n: coef[names.index(n)]))
    residual = y - x @ coef
    dof = max(1, len(y) - len(names))
    sigma2 = float(residual @ residual) / dof
    try:
        cov = sigma2 * np.linalg.inv(x.T @ x)
        errors = np.sqrt(np.clip(np.diag(cov), 0, None))
    except np.linalg.LinAlgError:
        errors = np.full(len(names), float("nan"))
    fitted = dict(zip(names, zip(coef, errors)))
    terms = tuple(
        Term(name, float(fitted[name][0]) if name in fitted else 0.0,
             float(fitted[name][1]) if name in fitted else 0.0)
        for name in columns
    )  # fmt: skip
    rms = float(np.sqrt(np.mean(residual**2))) if len(y) else float("nan")
    return Regression(terms, rms, len(y))


def fit_decode(samples: Sequence[DecodeSample]) -> Regression:
    """t0_ms, c_d, c_kv from decode steps."""
    if len({s.seqs for s in samples}) < 2:
        raise ValueError("the decode fit needs at least two batch sizes")
    y = np.array([s.step_ms for s in samples], dtype=float)
    return _least_squares({
        "t0_ms": np.ones(len(samples)),
        "c_d": np.array([s.seqs for s in samples], dtype=float),
        "c_kv": np.array([s.context_tokens for s in samples], dtype=float),
    }, y)  # fmt: skip


def fit_prefill(samples: Sequence[PrefillSample]) -> Regression:
    """The intercept (t0 + the client's overhead), c_p and c_q from lone prefills."""
    if len({s.prompt_tokens for s in samples}) < 3:
        raise ValueError("the prefill fit needs at least three prompt lengths")
    p = np.array([s.prompt_tokens for s in samples], dtype=float)
    y = np.array([s.ttft_ms for s in samples], dtype=float)
    return _least_squares({"intercept_ms": np.ones(len(samples)), "c_p": p, "c_q": p * p}, y)
