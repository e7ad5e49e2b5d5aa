"""First-principles systems simulator of sync vs async pipeline RL (see docs/sim.md).

  setup = build_setup(cfg)      # validated SimSetup from a ConfigDict (default_config())
  result = simulate(setup)      # SimResult; result.summary() is what summary.json holds
  sweep_split(cfg)              # best sampler/trainer split under a staleness limit
  calibrate(run_dir, setup)     # predicted vs measured for a real run directory
"""
from pipelinerl_jax.sim.calibrate import calibrate, read_run
from pipelinerl_jax.sim.sim_config import build_setup, default_config
from pipelinerl_jax.sim.hardware import ACCELERATORS, MODELS, Accelerator, ModelSpec, measure_cpu
from pipelinerl_jax.sim.latency import DecodeLatency, TrainTime, kv_capacity_tokens
from pipelinerl_jax.sim.lengths import Empirical, LogNormal
from pipelinerl_jax.sim.pipeline import SimResult, SimSetup, simulate
from pipelinerl_jax.sim.sweep import sweep_split

__all__ = ["ACCELERATORS", "MODELS", "Accelerator", "DecodeLatency", "Empirical", "LogNormal",
           "ModelSpec", "SimResult", "SimSetup", "TrainTime", "build_setup", "calibrate",
           "default_config", "kv_capacity_tokens", "measure_cpu", "read_run", "simulate",
           "sweep_split"]
