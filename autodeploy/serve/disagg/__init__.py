"""Disaggregated serving: prefill and decode workers, KV-cache transfer over gRPC, discovery in etcd, and the router."""
