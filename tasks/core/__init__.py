"""Leaves of ``tasks``: errors, the STAGEWISE_* contract, fsspec storage and the sub-jobs' CLI plumbing.

They import nothing else of the project (``stagewise.core`` modules may import each other).
"""
