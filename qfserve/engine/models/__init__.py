"""What runs: model loading (:mod:`.loading`), the catalog of known models
(:mod:`.catalog`), GGUF conversion (:mod:`.gguf`) and the CPU's BLAS (:mod:`.blas`).
"""
