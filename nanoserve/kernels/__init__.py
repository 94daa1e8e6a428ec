"""Building and loading the C++ extension modules (build.py); `python -m nanoserve.kernels` builds them."""
