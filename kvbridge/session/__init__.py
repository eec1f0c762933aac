"""One request's lifecycle between a prefill and a decode engine, engine-neutral.

- `machine`: the states of one decode pull (resolving -> leased -> reading -> landing -> confirming ->
  done / fenced / failed), the same for whole-request and layer-wise pulls.
- `decode`: `DecodeControl`, the decode side of a request (BeginPull, reads, DONEs, fencing);
  `layers`: the reading state of a layer-wise pull.
- `decoder`: a decode rank's pulls on threads of their own; `prefill`: a prefill rank's side channel,
  ledger, offers and streams (`stream`); `offers`: a prefill scheduler's early offers.
- `outbox`: what a rank tells its engine between steps, and the idle wait; `tasks`: what an engine asks
  its ranks to pull; `metrics`: what a rank records; `timeline`: a request's phases as the proxy shows them.

Engine adapters (`kvbridge.adapters.*`) map their engine's hooks onto these; nothing here imports an engine.
See docs/architecture.md.
"""
