"""Chat tests: one torch thread (see PLATFORM notes on OpenMP spin-waiting)."""

import torch

torch.set_num_threads(1)
