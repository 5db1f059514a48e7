"""Group stores on disk: groups of clean samples with their rewards, built once and trained on
offline (objective.kind gdro with rollout.kind offline). docs/offline.md describes the format."""
