"""Reachability, minimum depth and the hierarchy cost model of π-Attention."""

from .cost import PROFILES, HardwareProfile, dense_cost, online_cost, working_set_size
from .reachability import (
    attainable_span,
    coverage,
    min_depth,
    reachability_mask,
    reachability_with_sinks,
    sink_reach_depth,
    span,
    span_bound,
    spans_by_depth,
    step_mask,
)

__all__ = [
    "PROFILES",
    "HardwareProfile",
    "attainable_span",
    "coverage",
    "dense_cost",
    "min_depth",
    "online_cost",
    "reachability_mask",
    "reachability_with_sinks",
    "sink_reach_depth",
    "span",
    "span_bound",
    "spans_by_depth",
    "step_mask",
    "working_set_size",
]
