"""Examples, each a pipeline: a config (``<name>.yaml``) beside the spec or script it names.

Installed, this folder is ``stagewise.examples``; specs and scripts here import ``stagewise.spec`` and nothing else
of ours, as a user's own do.
"""
