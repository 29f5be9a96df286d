"""``spread.plan``: predict each strategy's speed and memory for a model and cluster, and advise.

Pipeline: :mod:`capture` finds the model in a script, :mod:`workload` profiles it on this device,
:mod:`calibration` holds the measured machine figures, :mod:`cluster` describes the target cluster,
:mod:`costs` has the closed-form cost terms, :mod:`predict` combines them per strategy and
:mod:`advisor` ranks and recommends; :mod:`report` prints the table and plots scaling.
"""

from spread.plan.advisor import Plan, PlanError, make_plan
from spread.plan.calibration import CalibrationError, CalibrationProfile, load_profile, save_profile
from spread.plan.cluster import ClusterModel
from spread.plan.costs import Link
from spread.plan.predict import Candidate, Options, Prediction, candidates, predict
from spread.plan.workload import ModelProfile, measure_model

__all__ = [
    "CalibrationError",
    "CalibrationProfile",
    "Candidate",
    "ClusterModel",
    "Link",
    "ModelProfile",
    "Options",
    "Plan",
    "PlanError",
    "Prediction",
    "candidates",
    "load_profile",
    "make_plan",
    "measure_model",
    "predict",
    "save_profile",
]
