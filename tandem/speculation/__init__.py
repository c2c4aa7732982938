"""The rules of speculative decoding: logits processing, verification, per-token reports. Pure functions over tensors."""
