"""Speed and memory studies (studies 6-11), one module and one command each.

| command | study |
| --- | --- |
| ``python -m bench.speed.decode`` | 6: decode ms/step, eviction overhead, kept KV and peak memory vs context |
| ``python -m bench.speed.ttft`` | 7: time to first token, eviction vs full, 1k / 2k / 4k prompts |
| ``python -m bench.speed.server_overhead`` | 8: HTTP streaming vs in-process generation |
| ``python -m bench.speed.vs_mlx_lm`` | 9: qfserve against ``mlx_lm.server`` on the same prompts |
| ``python -m bench.speed.bandwidth`` | 10: memory bandwidth vs bytes read per decoded token |
| ``python -m bench.speed.structured`` | 11: what a JSON-schema constraint costs per token |

Each takes the arguments of :mod:`bench.cli` (``--model``, default the served
SmolLM2-135M-Instruct; ``--quick``, CI-sized on the bundled qfserve-tiny; ``--reps``), writes
``bench/results/<model>/<study>.json`` plus PNG plots and prints a table. Shared plumbing:
:mod:`bench.models`, :mod:`bench.harness`, :mod:`qfserve.testing` (servers on loopback ports,
which the test suite uses too) and :mod:`bench.speed.common`.
"""
