"""Rollout: chat contexts, trajectories, the env manager, the feeder, routing."""
