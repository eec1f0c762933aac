"""Example kvbridge device plugin (see docs/plugins.md in kvbridge)."""
