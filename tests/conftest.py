import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_and_threads():
    """Seed every test; tiny tensors run on one intra-op thread so `pytest -n 2` does not
    oversubscribe the two cores (each worker otherwise spawns its own thread pool)."""
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
