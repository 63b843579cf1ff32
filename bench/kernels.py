"""Block-sparse kernel benchmark (GPU): `python bench/kernels.py [--out DIR]`.

Same as `mmjax bench kernels`; see mmjax/bench/kernels.py for what it measures.
"""

import sys

from mmjax.bench.kernels import main

if __name__ == "__main__":
    sys.exit(main())
