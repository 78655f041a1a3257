import os

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings

from tests._models import REQUIRES_CUDA

# The suite plans with the eager inner compiler (seconds per compile; Inductor takes a minute per
# model on a CPU); tests/test_inductor.py and the default's own test use Inductor explicitly.
# Examples and the command line run in subprocesses and inherit this.
os.environ.setdefault("CKPT_FX_COMPILER", "eager")

# Under pytest-xdist (the README's command runs two workers: tracing and compiling are mostly one
# Python thread), each worker's kernels take one thread so the two do not fight over the cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# CI: a fixed, derandomized set of examples. CKPT_FX_HYPOTHESIS=large: ten times as many, random.
settings.register_profile(
    "ci", max_examples=25, derandomize=True, deadline=None, print_blob=True,
    phases=(Phase.explicit, Phase.reuse, Phase.generate),  # shrinking recompiles many times: report as found
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "large", max_examples=250, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile(os.environ.get("CKPT_FX_HYPOTHESIS", "ci"))

DEVICES = ["cpu", pytest.param("cuda", marks=REQUIRES_CUDA)]


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def fresh_inductor_cache(tmp_path, monkeypatch):
    """Inductor's caches in a folder of the test's own: every compile in it is cold."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    yield tmp_path / "inductor"
