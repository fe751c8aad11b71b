"""multiturn-recall: what turn 1 said, asked turns later; ``--conversation chat`` (a pass key,
``multiturn_recall.py``) or ``document`` (facts in a document, KVzip among the arms, ``kvzip_reuse.py``)."""
