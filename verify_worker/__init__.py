"""Verify worker: owns the target model and each live session's KV cache."""
