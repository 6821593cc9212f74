"""Measuring the plugin: the evaluation prompt sets (datasets.py) and vLLM's OpenAI server
as a subprocess (server.py), for the benchmark harness and the tests."""
