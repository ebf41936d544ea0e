"""The crossover table's segments, ``[[upper_bound, impl], ..., [None, impl]]`` in increasing bound order:
derived from measurements, and read back on an axis value."""
from __future__ import annotations

import math


def derive_crossover(points: list[tuple[float, dict[str, float]]], margin: float = 0.05) -> list:
    """Segments from measurements: points are (axis value, {impl: median ms}).  A challenger takes over only
    when it beats the incumbent by more than `margin` (hysteresis, so noise cannot flip the choice back and
    forth); boundaries sit at the geometric mean of the two neighbouring measured axis values."""
    pts = sorted((a, t) for a, t in points if t)
    if not pts:
        raise ValueError("no measurements to derive a crossover from")
    segments: list = []
    incumbent = min(pts[0][1], key=pts[0][1].get)
    prev_axis = pts[0][0]
    for axis, times in pts[1:]:
        best = min(times, key=times.get)
        if best != incumbent and incumbent in times and times[best] < times[incumbent] * (1.0 - margin):
            bound = math.sqrt(max(prev_axis, 1e-12) * max(axis, 1e-12))
            segments.append([round(bound, 6), incumbent])
            incumbent = best
        elif incumbent not in times:
            incumbent = best
        prev_axis = axis
    segments.append([None, incumbent])
    return segments


def crossover_pick(segments: list, value: float) -> str:
    """The implementation of the segment holding `value` (past every bound: the last segment's)."""
    return next((impl for bound, impl in segments if bound is None or value < bound), segments[-1][1])
