"""Scheduling, liveness, memory planning and lowering to ExecutionPlans."""
from graphmode.plan.execution import ExecutionPlan, Instruction, Slot, lower
from graphmode.plan.liveness import Liveness, analyze_liveness
from graphmode.plan.memory import MemoryPlan, MemoryPlanSet, activation_peak_expr, bucket_key, plan_memory
from graphmode.plan.schedule import reference_env, schedule

__all__ = ["ExecutionPlan", "Instruction", "Slot", "lower", "Liveness", "analyze_liveness", "MemoryPlan",
           "MemoryPlanSet", "activation_peak_expr", "bucket_key", "plan_memory", "reference_env", "schedule"]
