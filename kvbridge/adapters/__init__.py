"""Engine adapters: one module or package per inference engine, each registered with that engine's own mechanism."""
