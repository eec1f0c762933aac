"""One request's lifecycle between a prefill and a decode engine, engine-neutral. See docs/internals.md."""
