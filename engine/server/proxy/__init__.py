"""`kvstash proxy`: one OpenAI-compatible endpoint in front of producer (prefill) and
consumer (decode) engines (docs/serving.md, "Disaggregated prefill/decode").

`pool` picks engines (fewest requests in flight, dead ones out for a while), `relay` runs
one request through a producer then a consumer, `app` is the FastAPI app, `metrics` its
Prometheus counters and `cli` the command. Nothing here imports torch or the engine: the
proxy only speaks HTTP to `kvstash serve` processes.
"""
