"""Pattern benchmark (GPU): `python bench/patterns.py [--out DIR]`; see mmjax/bench/patterns.py."""

import sys

from mmjax.bench.patterns import main

if __name__ == "__main__":
    sys.exit(main())
