"""Speculative decoding step costs (GPU): `python bench/speculative.py [--out DIR]`; see mmjax/bench/speculative.py."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mmjax.bench.speculative import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
