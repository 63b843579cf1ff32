"""MOMO benchmark (GPU): `python bench/momo.py [--out DIR]`.

Same as `mmjax.bench.momo`; see mmjax/bench/momo.py for what it measures.
"""

import sys

from mmjax.bench.momo import main

if __name__ == "__main__":
    sys.exit(main())
