"""Test and bench helpers that ship with kvbridge: a tiny offline model, real vLLM servers on loopback."""
