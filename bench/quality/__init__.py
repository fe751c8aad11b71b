"""Quality studies of KV-cache eviction on held-out data, one module (and command) per study.

=============  ==============================================  ===============================
study          command                                         question
=============  ==============================================  ===============================
1 geometry     ``python -m bench.quality.geometry``             are the queries anisotropic?
2 attention    ``python -m bench.quality.attention``            does each score predict attention?
3 perplexity   ``python -m bench.quality.perplexity``           streaming perplexity per budget
4 retrieval    ``python -m bench.quality.retrieval``            pass-key accuracy per compression
5 stability    ``python -m bench.quality.stability``            how stable is the calibration?
6 niah         ``python -m bench.quality.niah``                 a needle in English prose
=============  ==============================================  ===============================

Every command takes the arguments of :mod:`bench.cli` (``--model``, default the served
SmolLM2-135M-Instruct; ``--quick``, a CI-sized smoke run on the bundled qfserve-tiny), writes
``bench/results/<model>/<study>.json`` plus PNG plots, and prints a table;
``python -m bench.report`` renders the results page from the JSON. Shared with the speed
studies: :mod:`bench.cli`, :mod:`bench.models` (loading and identity) and
:mod:`bench.harness` (results writer, tables). Here: :mod:`~bench.quality.study` (load,
calibrate, save), :mod:`~bench.quality.data`
(held-out data from the training package's evaluation split), :mod:`~bench.quality.calib`
(calibrated filters), :mod:`~bench.quality.arms` (cache arms at matched budgets),
:mod:`~bench.quality.teacher` (teacher-forced streaming log-likelihood).

Importing this package does not import MLX (the report renderer imports it for its tables).
"""
