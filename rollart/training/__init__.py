"""Training: objectives, the sample buffer, backends (issue 4)."""
