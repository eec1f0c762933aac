"""`kvbridge proxy`: routes OpenAI API requests through a vLLM prefill server, then a decode server.

A server of its own, apart from the library: `app` (the proxy, wiring its rooms: `membership`, `handover`, `relay`,
`moves` and `takeover`, `admin`; their `settings`), `fanout` (batches split into one P/D request per choice), `cli`
(the `kvbridge proxy` subcommand, which `plugin` adds through the ``kvbridge_commands`` hook).
"""
