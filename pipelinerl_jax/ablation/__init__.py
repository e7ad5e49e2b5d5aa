"""Ablations on top of the pipeline: grids, their results tables and figures.

  grid.py     ablation config (`ablation_config`, `sweep`, `variants`) -> runs (`expand`)
  runner.py   shared warm start, resumable parallel execution (`run_grid`)
  results.py  run directories -> tidy CSV, per-run and per-cell summaries (`write_tables`)
  figures.py  every figure from logged runs (`make_all`); see docs/experiments.md
"""
