"""GGUF files (llama.cpp, Ollama, LM Studio) as mlx-lm models.

A GGUF file is read with llama.cpp's own ``gguf`` package (metadata, tensor types) and MLX's
``mx.load`` (tensor data), turned into an mlx-lm folder once (:mod:`qfserve.engine.models.gguf.convert`) and
served from that folder like any other. :mod:`qfserve.engine.models.gguf.reader` maps architectures and
tensor names; :mod:`qfserve.engine.models.gguf.tokenizer` rebuilds the tokenizer and chat template.
"""

from qfserve.engine.models.gguf.reader import GGUFError

__all__ = ["GGUFError"]
