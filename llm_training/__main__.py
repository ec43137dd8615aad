"""`python -m llm_training ...` is the same as `python -m llm_training.train ...`."""

import sys

from llm_training.train import main

sys.exit(main())
