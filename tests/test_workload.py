"""The notebook helpers: workload sizes per device, and the one line each chapter opens with."""

import torch

from minillm.workload import ON_GPU, describe_machine, setup_chapter, size


def test_size_picks_the_device_value():
    assert size("cpu", "gpu") == ("gpu" if ON_GPU else "cpu")


def test_setup_chapter_fixes_the_threads_and_names_the_machine():
    before = torch.get_num_threads()
    try:
        line = setup_chapter()
        assert line.startswith("Ran on: ") and f"torch {torch.__version__}" in line and "GiB RAM" in line
        assert ON_GPU or (torch.get_num_threads() == 1 and "1 PyTorch thread;" in line and "no GPU" in line)
        assert line == describe_machine()
    finally:
        torch.set_num_threads(before)
