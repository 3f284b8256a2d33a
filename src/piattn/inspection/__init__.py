"""Looking inside trained models: attention mass per key class (local, skip, sink), the gate α and its
skip prior 1 − α by position modulo π, token flow through the layers, and the figures of `piattn inspect`.

    from piattn.inspection import Inspector, plot_token_flow, plot_gate_dynamics, plot_skip_prior_by_phase
    with Inspector(model) as inspector:
        task.evaluate(model, "validation", 4)          # any forwards over data
    report = inspector.result()
"""

from .capture import Inspector, default_position, kind_name
from .figures import gate_series, plot_gate_dynamics, plot_skip_prior_by_phase, plot_token_flow
from .probes import KEY_CLASSES, columns, layer_weights, masses, slot_classes

__all__ = ["KEY_CLASSES", "Inspector", "columns", "default_position", "gate_series", "kind_name", "layer_weights",
           "masses", "plot_gate_dynamics", "plot_skip_prior_by_phase", "plot_token_flow", "slot_classes"]
