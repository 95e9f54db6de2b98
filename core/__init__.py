"""The vendor-neutral engine: never imports triton, cuda-python or hip-python."""
