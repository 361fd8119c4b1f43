"""A tensor-parallel worker on the fake GPUs of tests/fake_cuda.py (FAKE_CUDA_GPUS of them): what
rank 0's launcher starts in the CPU rehearsal of a multi-GPU group (tests/test_tp_gpu_rehearsal.py).
Everything but torch.cuda's answers is the real worker."""
import os
import sys

import pytest

from fake_cuda import GIB, MIB, FakeCuda, FakeGpu

if __name__ == "__main__":
    # the same figures as the rehearsal's rank 0 (odd GPUs have less free memory)
    gpus = [FakeGpu(2 * GIB, 512 * MIB if i % 2 else 768 * MIB, 32 * MIB, 48 * MIB)
            for i in range(int(os.environ["FAKE_CUDA_GPUS"]))]
    FakeCuda(gpus=gpus).install(pytest.MonkeyPatch())
    from backend.worker.parallel.worker import main
    sys.exit(main())
