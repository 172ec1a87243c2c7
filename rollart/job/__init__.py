"""The main job: ``rollart run`` (all stages as processes, supervised) and its report."""
