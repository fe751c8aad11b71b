"""KVzap (arXiv 2601.07891): a small surrogate per layer that predicts, from the hidden state
that enters a layer's attention, the log of the KVzip+ score the key it writes would get.

KVzip (:mod:`qfserve.engine.kv.kvzip`) scores a key by the attention a reconstruction of the
context pays it, which costs a second pass over the prompt. KVzap learns that score offline so
a key can be scored when it is written, at the cost of one small product per row:

- :mod:`.hidden`: a tap on each layer's input norm, whose output is the surrogate's input;
- :mod:`.targets`: the KVzip+ scores of one text, from one forward over the text, the repeat
  instruction and the text again (the target a surrogate learns);
- :mod:`.surrogate`: the per-layer surrogates (linear, or a two-layer MLP), their forward,
  fitting (ridge in closed form, the MLP by AdamW in MLX) and their artifact file;
- :mod:`.train`: the text they are trained and evaluated on, and the command's steps.

The eviction side is :mod:`qfserve.engine.kv.kvzap`.
"""
