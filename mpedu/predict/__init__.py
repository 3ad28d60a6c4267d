"""Predictions before running: per-layer profiles and cost curves, the simulator, the memory model and
the memory cap, partitioning, bounds and the planner. Imports the layers below (runtime ... core)."""
from . import planner
from .bounds import held_units, memory_floor, time_bound
from .calibration import fit_link
from .capacity import MemoryCapError, MemoryGuard, cap_memory, memory_estimate
from .cores import measure_cores
from .costcurve import CostCurve, profile_curve
from .costmodel import GPUSpec, gpu_costs, layer_times
from .footprint import device_footprints, param_sizes, peak_held, stage_footprint, unit_bytes
from .memory import DeviceMemory, MemoryReport, measured_peak, memory_report
from .partition import balance, balance_by_params, balance_by_time, balance_v, balance_v_by_time, to_placement
from .planner import RECOMPUTE, SCHEDULES, plan, plan_buckets, predict, search_shapes
from .plans import Candidate, PlanStopped
from .profiling import Costs, StageCost, profile
from .ranking import Measurement, kendall_tau, measure, tau_apart, told_apart
from .epochs import predict_epoch
from .overlap import overlap_saving
from .simulator import peak_in_flight, simulate

__all__ = [
    "Candidate", "CostCurve", "Costs", "DeviceMemory", "GPUSpec", "Measurement", "MemoryCapError", "MemoryGuard",
    "MemoryReport", "PlanStopped", "RECOMPUTE", "SCHEDULES", "StageCost", "balance", "balance_by_params", "balance_by_time", "balance_v", "balance_v_by_time", "cap_memory", "device_footprints",
    "fit_link", "gpu_costs", "held_units", "kendall_tau", "layer_times", "measure", "measure_cores",
    "measured_peak", "memory_estimate", "memory_floor", "memory_report", "overlap_saving", "param_sizes", "peak_held",
    "peak_in_flight", "plan", "plan_buckets", "planner", "predict", "predict_epoch", "profile",
    "profile_curve", "search_shapes", "simulate", "stage_footprint",
    "tau_apart", "time_bound", "to_placement", "told_apart", "unit_bytes",
]
