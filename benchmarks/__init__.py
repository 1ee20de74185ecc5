"""Benchmarks: kernel timings (kernels.py) and RAG serving (rag_serving.py)."""
