"""Test support: the real sglang 0.5.23 on CPU, in a venv the tests build and cache (see ``env.py``)."""
