"""core/kv"""
