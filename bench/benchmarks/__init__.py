"""One module per benchmark: ``SUMMARY``, ``TARGETS``, ``DEFAULT_TARGETS``, ``add_arguments(parser)`` and
``run(ctx) -> Result`` (bench/registry.py lists them)."""
