"""The harness every benchmark shares: processes (start, pin, stop), CPU accounting from /proc, runs in turns and
their comparisons, a run's context, results as JSON and Markdown, pictures."""
