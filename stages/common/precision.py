"""The precisions a stage computes in: the choices of a params section's `precision` key, checked when the
section loads without torch (stages.common.runtime.compute_dtype maps them to torch dtypes)."""

from __future__ import annotations

PRECISIONS = ("auto", "fp32", "bf16", "fp16")


def check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision: unknown precision {precision!r}; valid: {', '.join(PRECISIONS)}")
