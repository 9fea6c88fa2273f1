"""`lmbatch run`, the storyline: the workload prepared beside the model's loading, executed, its finished
programs written as parts, summary.json at the end (`run.run` reads top to bottom)."""
