"""kvbridge's tools, apart from the library: benches, chaos runs and the test harness.

- `kvbridge bench`, `kvbridge chaos` and `kvbridge trace` (`kvbridge_tools.cli`), found by the `kvbridge`
  CLI through the ``kvbridge_commands`` hook of `plugin` (entry point ``tools`` in the ``kvbridge`` group);
- `bench`: the verified prefill -> decode migration benches and `strategy`, the gather-or-direct choice
  they make per request;
- `chaos`: faults against a vLLM deployment behind `kvbridge proxy`;
- `harness`: what the benches, chaos runs and kvbridge's own tests start: network-namespace hosts, real
  vLLM servers, a tiny offline model, free ports, and the GPU kit behind scripts/gpu-pack and gpu-check.

kvbridge never imports this package (tests/unit/test_import_graph.py checks it).
"""
