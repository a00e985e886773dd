"""Automatic configuration: device profiles, a memory and speed model of a deployment, and the planner that picks
settings from them with their reasons (``autodeploy plan``, ``autodeploy check``, ``config show --explain``)."""

from autodeploy.planning.devices import PROFILES, DeviceProfile, current_profile, profile
from autodeploy.planning.estimate import ModelShape, SpeedModel, memory_use
from autodeploy.planning.planner import Plan, PlanRequest, plan

__all__ = ["PROFILES", "DeviceProfile", "ModelShape", "Plan", "PlanRequest", "SpeedModel", "current_profile", "memory_use", "plan",
           "profile"]
