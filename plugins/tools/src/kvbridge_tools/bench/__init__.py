"""Benchmarks behind `kvbridge bench`: each mode is a module with `add_arguments(group)` and `run(args)`."""
