"""backends/rocm"""
