"""Mutation testing of the numerical core: ``python -m mutation.run`` (``make mutate``)."""
