"""Workloads that measure: bench reports, batching sweeps, comparisons, process/device memory."""
