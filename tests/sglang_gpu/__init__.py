"""Test support: the GPU machine's package set and the carried SGLang 0.5.17 bundle, built and cached by the
tests (see ``env.py``)."""
