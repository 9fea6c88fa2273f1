"""Scores and what is read from finished runs: metrics with their standard errors (`task_results`,
`stats`), `lmbatch report`'s tables and comparisons (`report`) and its HTML page (`report_html`)."""
