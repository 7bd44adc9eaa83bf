"""The config schema by section, each beside the others it needs; stagewise.definitions.config assembles them."""
