"""engine.host_threads: one torch host thread for GPU engines unless the user chose."""

from __future__ import annotations

import torch

from engine.host_threads import host_threads_for


def test_a_gpu_engine_uses_one_host_thread():
    assert host_threads_for(torch.device("cuda", 0), {}) == 1


def test_the_users_omp_setting_wins():
    assert host_threads_for(torch.device("cuda"), {"OMP_NUM_THREADS": "8"}) is None


def test_a_cpu_engine_keeps_its_threads_for_the_model():
    assert host_threads_for(torch.device("cpu"), {}) is None
