"""Models: building a spec's module, the built-in MLP, torch file I/O, model bundles and the scoring device."""
