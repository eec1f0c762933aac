"""Engine adapters: one module or package per inference engine, registered with that engine's own mechanism."""
