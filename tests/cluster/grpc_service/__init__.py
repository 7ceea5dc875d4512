"""Tests of cluster/grpc_service/: proto <-> generation requests and chunks."""
