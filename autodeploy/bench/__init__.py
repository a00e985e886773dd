"""``autodeploy bench``: latency, throughput, memory and accuracy benchmarks with regression detection."""
