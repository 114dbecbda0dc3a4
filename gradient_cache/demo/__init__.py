"""The main job, `gradient-cache demo`, and what it measures with: models, CPU device-memory
accounting, the report."""
