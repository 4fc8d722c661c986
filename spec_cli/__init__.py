"""spec-cli: speculative decoding of GGUF models in PyTorch, shaped like llama.cpp's tools."""

__version__ = "0.1.0"
