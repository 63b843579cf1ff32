"""Mixed-modality benchmark (GPU): `python bench/mixed.py [--out DIR]`; see mmjax/bench/mixed.py."""

import sys

from mmjax.bench.mixed import main

if __name__ == "__main__":
    sys.exit(main())
