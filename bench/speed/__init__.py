"""Speed and memory studies (issue 7, studies 6-10), one module and one command each.

| command | study |
| --- | --- |
| ``python -m bench.speed.decode`` | 6: decode ms/step, eviction overhead, kept KV and peak memory vs context |
| ``python -m bench.speed.ttft`` | 7: time to first token, eviction vs full, 1k / 2k / 4k prompts |
| ``python -m bench.speed.server_overhead`` | 8: HTTP streaming vs in-process generation |
| ``python -m bench.speed.vs_mlx_lm`` | 9: qfserve against ``mlx_lm.server`` on the same prompts |
| ``python -m bench.speed.bandwidth`` | 10: memory bandwidth vs bytes read per decoded token |

Each takes ``--quick`` (CI-sized) and ``--model`` (a folder, or ``tiny`` for the random test
model), writes ``bench/results/<study>.json`` plus PNG plots and prints a table. Shared
plumbing lives in :mod:`bench.speed.common` and :mod:`bench.harness`.
"""
