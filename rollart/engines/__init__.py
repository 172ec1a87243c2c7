"""LLM engines driven by the generation stage (vLLM; CPU build here, CUDA build on GPU pools)."""
