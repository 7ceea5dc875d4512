"""Tests of cluster/serving/: the ingress, bring-up, streams, metrics, security and `specserve serve`."""
