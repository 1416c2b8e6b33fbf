"""Benchmark cases: every module here is imported by ``registry.load_cases``
and registers its cases with ``@register``. Add a case by adding a module."""
