"""Built-in device plugins."""
