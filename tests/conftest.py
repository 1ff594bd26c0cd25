"""Test setup: the tiny models in tests/models.py, one intra-op thread (the test models are
far too small to gain from more, and a busy 2-core machine makes OpenMP thrash)."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
torch.set_num_threads(1)
