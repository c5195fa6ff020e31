"""Benchmarks beside the engine, not part of it: `offline` (`nextn bench`: decode, speculation,
batches and the roofline on a checkpoint or a preset), `measure` (timing and bandwidth), `sweeps`
(its sweeps over K, batch sizes and sampling), `roofline` (bytes read per token from the routing),
`serve` (`nextn bench serve`, vLLM's served benchmark against any OpenAI-compatible server)."""
