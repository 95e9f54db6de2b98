"""DeepSeek-V4: mHC residual streams, compressed sparse / heavily compressed attention, hash and routed MoE."""
