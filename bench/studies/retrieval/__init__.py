"""retrieval: a needle by length, compression and depth; ``--haystack passkey`` (a pass key
in repeated filler, ``retrieval.py``) or ``prose`` (a sentence in English prose, ``niah.py``)."""
