"""What benches, chaos runs and kvbridge's tests start: hosts, vLLM servers, a tiny model, free ports, the GPU kit."""
