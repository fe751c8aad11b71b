"""An over-long prompt is the server's to refuse: the tokenizer does not log about it."""

from __future__ import annotations

import logging

from qfserve.engine.models.loading import load_model


def test_encoding_past_the_context_logs_no_tokenizer_warning(caplog):
    from transformers.utils import logging as hf_logging

    loaded = load_model("qfserve-tiny")
    hf_logging.enable_propagation()  # transformers keeps its records from the root logger
    with caplog.at_level(logging.WARNING):
        ids = loaded.tokenizer.encode("hello " * (2 * loaded.context_length))
    assert len(ids) > loaded.context_length  # the prompt is over-long ...
    assert loaded.context_length == 2048  # ... the context still the model's own
    hf_logging.disable_propagation()
    assert not [r for r in caplog.records if "indexing errors" in r.getMessage()]
