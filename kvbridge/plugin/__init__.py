"""The plugin layer: hooks, specs, the registry, and which device a registered buffer belongs to."""
