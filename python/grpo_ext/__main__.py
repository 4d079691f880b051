"""``python -m grpo_ext``: the ``grpo-ext`` command (trainer/cli.py), for an environment whose scripts folder is not on
PATH."""

import sys

from .trainer.cli import main

if __name__ == "__main__":
    sys.exit(main())
