"""``python -m gradientflow.kernels``: compile every CPU kernel into numba's cache (warm.py)."""
import sys

from .warm import main

sys.exit(main())
