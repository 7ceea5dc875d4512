"""Tests of cluster/config/: the Serve YAML args, the configuration reference and placement."""
