"""Tests of cluster/schemas/: the HTTP request schemas, chat prompts and their conversion."""
