"""Benchmarks: ``engine bench offline|serve`` (offline.py, serve.py) and the device scripts beside
them, each run as ``python benchmarks/NAME.py``; results as JSON in results/ with the device named."""
