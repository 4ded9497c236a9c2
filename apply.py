#!/usr/bin/env python3
"""apply.py: the TensorFold patch series tool (apply | check | status | export | rebase | new).

`python apply.py --upstream v0.6.0` gives a patched TensorFold checkout in build/tensorfold,
pinned and verified. Exit codes and the maintainer workflow: docs/MAINTAINERS.md.
"""
from seriestool.cli import main

if __name__ == "__main__":
    main()
