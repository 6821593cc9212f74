"""Measuring the plugin: the evaluation prompt sets (datasets.py), vLLM's OpenAI server
as a subprocess (server.py) and paired bootstrap intervals (bootstrap.py), for the
benchmark harness, the drafter evaluator and the tests."""
