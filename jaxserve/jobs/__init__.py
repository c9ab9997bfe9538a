"""Offline batch jobs: `jaxserve batch` runs an OpenAI batch JSONL file through one engine.

input.py parses lines into requests (or line errors), output.py keeps the durable, resumable
results file, runner.py drives the engine, merge.py joins shard outputs, command.py is the CLI.
"""
